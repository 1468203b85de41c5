"""Hostile command lines, a table per command: each is refused before anything starts (no model loaded, no
file written, no port bound) with one line on stderr naming the flag and exit code 2, and no input changes;
``export-chat`` onto its own model (by path, through links, with ``--link``, into the model's folder) above
all. The table runs in-process (fast); the serve rows run again as processes, as a user starts them."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchgpu import cli, flags
from batchgpu.errors import BatchError, DeviceError
from batchgpu.export.chat import export_chat
from batchgpu.models.synth import write_synthetic

from .servers import free_port
from .test_cache import ROOT, python_env

CONTEXT = 256  # tiny-llama's trained context


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model, an earlier export of it, a file that is not GGUF, a folder without config.json, a script,
    an encoder's folder (its config alone), a named pipe."""
    root = tmp_path_factory.mktemp("flags")
    model = write_synthetic(root / "tiny.gguf", "tiny-llama", "q8_0", show=False).path
    export = export_chat(model, root / "app", max_context=32, chunk=8, gpu_kernels=False)
    (root / "notes.txt").write_text("not a model")
    (root / "empty").mkdir()
    (root / "script.py").write_text("print('ran')\n")
    os.mkfifo(root / "pipe.gguf")  # opening it to read would wait for a writer forever
    (root / "bert").mkdir()
    (root / "bert" / "config.json").write_text('{"model_type": "bert"}')
    return {"model": model, "export": export, "text": root / "notes.txt", "empty": root / "empty",
            "script": root / "script.py", "bert": root / "bert", "pipe": root / "pipe.gguf", "root": root}  # fmt: skip


SERVE = [  # (arguments after --model {model}, the flag the refusal names)
    (["--port", "99999"], "--port"),
    (["--port", "65536"], "--port"),
    (["--port", "0"], "--port"),
    (["--port", "-1"], "--port"),
    (["--port", "http"], "--port"),
    (["--host", ""], "--host"),
    (["--host", "no-such-host.invalid"], "--host"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-batch", "-4"], "--max-batch"),
    (["--max-batch", str(10**8)], "--max-batch"),
    (["--max-batch", "2.5"], "--max-batch"),
    (["--max-context", "0"], "--max-context"),
    (["--max-context", str(10**8)], "--max-context"),
    (["--max-context", str(CONTEXT + 1)], "--max-context"),  # past the model's trained context
    (["--max-context", "2048"], "--max-context"),  # the default is past it too: refused, never clipped
    (["--max-step-tokens", "0"], "--max-step-tokens"),
    (["--max-step-tokens", "4"], "--max-step-tokens"),  # below --max-batch's default 8
    (["--max-batch", "16", "--max-step-tokens", "8"], "--max-step-tokens"),
    (["--max-step-tokens", str(10**9)], "--max-step-tokens"),
    (["--speculative", "ngram"], "--speculative"),
    (["--speculative", "ngram:0"], "--speculative"),
    (["--speculative", "lookup:4"], "--speculative"),
    (["--speculative", "draft:4"], "--speculative"),
    (["--speculative", "draft:/no/such.gguf:4"], "--speculative"),
    (["--header-timeout", "-1"], "--header-timeout"),
    (["--header-timeout", "nan"], "--header-timeout"),
    (["--body-timeout", "inf"], "--body-timeout"),
    (["--body-timeout", "x"], "--body-timeout"),
    (["--kv-blocks", "0"], "--kv-blocks"),
    (["--kv-blocks", str(2**40)], "--kv-blocks"),
    (["--block-size", "0"], "--block-size"),
    (["--block-size", str(10**6)], "--block-size"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
    (["--max-request-bytes", str(2**40)], "--max-request-bytes"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--max-waiting", str(10**12)], "--max-waiting"),
    (["--max-connections", "0"], "--max-connections"),
    (["--max-connections", "many"], "--max-connections"),
    (["--replicas", "0"], "--replicas"),
    (["--gpus-per-replica", "-1"], "--gpus-per-replica"),
    (["--gpus-per-replica", "nan"], "--gpus-per-replica"),
    (["--cpus-per-replica", "inf"], "--cpus-per-replica"),
    (["--device", "tpu"], "--device"),
    (["--device", ""], "--device"),
    (["--model", "{root}/missing.gguf"], "--model"),
    (["--model", "{text}"], "--model"),  # a file that is not GGUF
    (["--model", "{empty}"], "--model"),  # a directory without config.json
    (["--model", "{export}"], "--model"),  # a directory of something else
    (["--model", "{pipe}"], "--model"),
    (["--model", "{bert}", "--ray"], "--ray"),  # an encoder is served in one process
    (["--unknown-flag"], "--unknown-flag"),
]

COMMANDS = [  # (a whole command line, the flag the refusal names)
    (["synth", "--preset", "llama-9b", "--format", "q8_0", "--out", "{root}/s.gguf"], "--preset"),
    (["synth", "--preset", "tiny-llama", "--format", "q3_k", "--out", "{root}/s.gguf"], "--format"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--vocab", "x", "--out", "{root}/s.gguf"], "--vocab"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--seed", "-1", "--out", "{root}/s.gguf"], "--seed"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--seed", str(2**70), "--out", "{root}/s.gguf"], "--seed"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--seed", "x", "--out", "{root}/s.gguf"], "--seed"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--out", "{root}/no/s.gguf"], "--out"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--out", "{root}"], "--out"),
    (["synth", "--preset", "tiny-llama", "--format", "q8_0", "--out", "{text}"], "--out"),  # not a GGUF to replace
    (["synth", "--preset", "tiny-llama", "--format", "q8_0"], "--out"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", "0"], "--max-context"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", str(10**8)], "--max-context"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", str(CONTEXT + 1)], "--max-context"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", "64", "--chunk", "3"], "--chunk"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", "64", "--chunk", "128"], "--chunk"),
    (["export-chat", "{root}/new", "--model", "{model}", "--max-context", "64", "--chunk", "-8"], "--chunk"),
    (["export-chat", "{root}/new", "--model", "{model}", "--speculative-tokens", "-1"], "--speculative-tokens"),
    (["export-chat", "{root}/new", "--model", "{model}", "--speculative-tokens", "65"], "--speculative-tokens"),
    (
        ["export-chat", "{root}/new", "--model", "{model}", "--max-context", "64", "--speculative-tokens", "64"],
        "--speculative-tokens",
    ),
    (["export-chat", "{root}/new", "--model", "{model}", "--speculative-tokens", "2.5"], "--speculative-tokens"),
    (["export-chat", "{root}/new", "--model", "{root}/missing.gguf", "--max-context", "64"], "--model"),
    (["export-chat", "{root}/new", "--model", "{text}", "--max-context", "64"], "--model"),
    (["export-chat", "{root}/new", "--model", "{empty}", "--max-context", "64"], "--model"),
    (["export-chat", "{root}/new", "--model", "{pipe}", "--max-context", "64"], "--model"),
    (["export-chat", "{text}", "--model", "{model}", "--max-context", "64"], "out"),  # a file
    (["export-chat", "{root}", "--model", "{text}", "--max-context", "64"], "--model"),  # the model's own folder
    (["export-chat", "{root}/new", "--max-context", "64"], "--model"),
    (["bench", "--ops", "0,10"], "--ops"),
    (["bench", "--ops", "10,x"], "--ops"),
    (["bench", "--ops", str(10**9)], "--ops"),
    (["bench", "--ops", "9" * 5000], "--ops"),  # past int()'s digits
    (["bench", "--repeat", "0"], "--repeat"),
    (["bench", "--plot", "{root}"], "--plot"),
    (["bench", "--json", "{root}/no/b.json"], "--json"),
    (["bench", "--plot", "{root}/b.png", "--json", "{root}/b.png"], "--json"),
    (["profile", "{root}/missing.py"], "script"),
    (["profile", "{empty}"], "script"),
    (["profile", "--top", "0", "{script}"], "--top"),
    (["profile", "--top", "-2", "{script}"], "--top"),
    (["profile", "--trace", "{script}", "{script}"], "--trace"),  # the trace would overwrite the script
    (["profile", "--trace", "{root}", "{script}"], "--trace"),
    (["check", "--workers", "-1"], "--workers"),
    (["check", "--workers", str(10**6)], "--workers"),
    (["check", "--budget", "0"], "--budget"),
    (["check", "--budget", "nan"], "--budget"),
    (["check", "--suite-timeout", "-5"], "--suite-timeout"),
    (["check", "--suite-timeout", "inf"], "--suite-timeout"),
    (["check", "--bench", "nosuch"], "--bench"),
    (["check", "--executors", "wgpu,tpu"], "--executors"),
    (["check", "--out", "{text}"], "--out"),
    (["check", "--out", "{text}/sub"], "--out"),
    (["info", "--bogus"], "--bogus"),
    (["nosuch"], "nosuch"),
]


def filled(argv: list[str], files: dict[str, Path]) -> list[str]:
    return [arg.format(**{name: str(path) for name, path in files.items()}) for arg in argv]


def fingerprint(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` (links followed) by its path: its size and SHA-256."""
    found = {}
    for folder, _dirs, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            if path.is_file():
                data = path.read_bytes()
                found[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return found


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``batchgpu ARGV`` (in this process) refuses it with, after checking its exit code 2."""
    try:
        code = cli.main(argv)
    except SystemExit as exited:  # argparse's own errors
        code = exited.code
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == "", captured
    return lines[0]


@pytest.mark.parametrize(("argv", "flag"), SERVE + COMMANDS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_command_refuses_a_hostile_flag_in_one_line(files, capsys, argv, flag):
    port = str(free_port())  # a row's own --port comes later and wins; the others do not meet a port in use
    argv = filled(["serve", "--model", "{model}", "--port", port, *argv] if argv[0].startswith("--") else argv, files)
    before = fingerprint(files["root"])
    line = refusal(argv, capsys)
    assert line.startswith("batchgpu"), line
    assert f"{flag} " in line or f"{flag}:" in line or f"'{flag}'" in line, line
    assert fingerprint(files["root"]) == before  # nothing written, nothing deleted


def test_flag_refusals_say_what_the_value_must_be(files, capsys):
    model = str(files["model"])
    assert refusal(["serve", "--model", model, "--port", "99999"], capsys) == (
        "batchgpu serve: --port must be at most 65535, got 99999"
    )
    assert refusal(["serve", "--model", model, "--device", "tpu"], capsys) == (
        "batchgpu serve: --device must be one of wgpu, reference, cuda, hip, got 'tpu'"
    )
    port = str(free_port())  # the rules after --port's run on a free one
    assert refusal(["serve", "--model", model, "--port", port, "--max-context", "2048"], capsys) == (
        f"batchgpu serve: --max-context must be at most {CONTEXT} (the model's trained context), got 2048"
    )
    assert refusal(["serve", "--model", str(files["empty"]), "--port", port], capsys).endswith(
        "(a directory without config.json)"
    )
    assert refusal(["serve", "--model", model, "--port", "x"], capsys).startswith(
        "batchgpu serve: argument --port: invalid int value: 'x'"
    )


def test_the_default_context_is_lowered_to_the_trained_one(files):
    """Without --max-context, serve and export-chat take their default lowered to the model's trained context
    (checked on the parsed flags: serving it would run until stopped)."""
    model = str(files["model"])
    for argv, expected in [
        (["serve", "--model", model, "--port", str(free_port())], CONTEXT),
        (["serve", "--model", model, "--port", str(free_port()), "--max-context", "64"], 64),
        (["export-chat", str(files["root"] / "new"), "--model", model], CONTEXT),
    ]:
        args = cli.build_parser().parse_args(argv)
        flags.check(args)
        assert flags.max_context(args) == expected, argv


def test_an_unknown_device_in_the_environment_is_named(files, capsys, monkeypatch):
    monkeypatch.setenv("BATCHGPU_DEVICE", "tpu")
    line = refusal(["serve", "--model", str(files["model"]), "--max-context", "64"], capsys)
    assert line.startswith("batchgpu serve: $BATCHGPU_DEVICE must be one of wgpu, reference, cuda, hip, got 'tpu'")
    assert refusal(["bench", "--quick"], capsys).startswith("batchgpu bench: $BATCHGPU_DEVICE must be one of")


def test_serve_refuses_a_port_in_use(files, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(["serve", "--model", str(files["model"]), "--max-context", "64", "--port", str(port)], capsys)
    assert line.startswith(f"batchgpu serve: --port must be a port free on 127.0.0.1, got {port}"), line


# export-chat onto its own model --------------------------------------------------------------------------


def own_model_cases(files: dict[str, Path]) -> dict[str, list[str]]:
    """``export-chat`` command lines whose model the export would overwrite or delete."""
    root, export = files["root"], files["export"]
    (root / "by-symlink.gguf").unlink(missing_ok=True)
    (root / "by-symlink.gguf").symlink_to(export / "model.gguf")
    (root / "by-hardlink.gguf").unlink(missing_ok=True)
    os.link(export / "model.gguf", root / "by-hardlink.gguf")
    (root / "app-link").unlink(missing_ok=True)
    (root / "app-link").symlink_to(export, target_is_directory=True)
    model, app = str(export / "model.gguf"), str(export)
    steps = ["--max-context", "32", "--chunk", "8"]
    return {
        "by path": ["export-chat", app, "--model", model, *steps],
        "by path, --link": ["export-chat", app, "--model", model, *steps, "--link"],
        "by symlink": ["export-chat", app, "--model", str(root / "by-symlink.gguf"), *steps],
        "by hardlink": ["export-chat", app, "--model", str(root / "by-hardlink.gguf"), *steps],
        "by hardlink, --link": ["export-chat", app, "--model", str(root / "by-hardlink.gguf"), *steps, "--link"],
        "through a linked folder": ["export-chat", str(root / "app-link"), "--model", model, *steps],
        "from the linked folder": ["export-chat", app, "--model", str(root / "app-link" / "model.gguf"), *steps],
        "into the model's folder": ["export-chat", str(root), "--model", str(files["model"]), *steps],
    }


def test_export_chat_never_deletes_its_own_model(files, capsys):
    for name, argv in own_model_cases(files).items():
        before = fingerprint(files["root"])
        line = refusal(argv, capsys)
        assert line.startswith("batchgpu export-chat: --model must be a file "), (name, line)
        assert fingerprint(files["root"]) == before, name


# serve: refused before uvicorn starts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--port", "99999"], "--port"), (["--port", "0"], "--port"), (["--max-batch", "0"], "--max-batch"),
     (["--max-context", str(10**8)], "--max-context"), (["--device", "tpu"], "--device"),
     (["--model", "{text}"], "--model"), (["--model", "{empty}"], "--model"),
     (["--model", "{root}/missing.gguf"], "--model")],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)  # fmt: skip
def test_serve_exits_before_uvicorn_starts(files, argv, flag):
    command = ["serve", "--model", str(files["model"]), "--port", str(free_port()), *filled(argv, files)]
    done = subprocess.run([sys.executable, "-m", "batchgpu", *command], env=python_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"batchgpu serve: {flag} must be "), done.stderr
    assert "Uvicorn" not in done.stderr and "Started server process" not in done.stdout + done.stderr


def test_an_engine_that_cannot_be_made_stops_serve_before_the_port_is_bound(files, capsys, monkeypatch):
    """The engine is made before uvicorn binds the port: its failure is one line, exit code 2 for what the
    flags ask (a BatchError) and 1 for the device (DeviceError), and the port stays free."""
    from batchgpu.llm import server
    from batchgpu.llm.options import EngineOptions

    port = free_port()

    def refuse() -> None:
        raise BatchError("Engine: no room")

    with pytest.raises(BatchError, match="no room"):
        server.serve(refuse, model_name="tiny", port=port)
    for error, code in ((BatchError("Engine: no room"), 2), (DeviceError("device lost"), 1)):

        def make(self: EngineOptions, adapter: int | None = None, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(EngineOptions, "make", make)
        argv = ["serve", "--model", str(files["model"]), "--max-context", "64", "--port", str(port)]
        argv.append("--no-engine-process")  # made in this process, where make is patched
        assert cli.main(argv) == code
        assert capsys.readouterr().err == f"batchgpu serve: could not start: {error}\n"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nothing listened


def test_every_command_has_rules_for_its_flags():
    """Each command's rules name flags it has (a renamed flag cannot leave a rule checking nothing), and every
    flag taking a value of a command with values to check has a rule."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(flags.RULES) == set(commands)
    unchecked = {"ray_address", "tests", "args"}  # free text: a Ray address, pytest's arguments, the script's
    for name, command in commands.items():
        dests = {action.dest for action in command._actions}
        ruled = {flags.dest(rule.flag) for rule in flags.RULES[name] if not rule.flag.startswith("$")}
        assert ruled <= dests, (name, ruled - dests)
        valued = {a.dest for a in command._actions if a.nargs != 0 and a.dest not in unchecked}
        assert valued <= ruled, (name, valued - ruled)
