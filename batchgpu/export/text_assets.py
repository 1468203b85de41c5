"""Temporary stand-in (the real module comes from the text branch)."""

import json
from pathlib import Path
from typing import Any


def write_text_assets(codec: Any, out: Path) -> None:
    (out / "tokenizer.json").write_text(codec.tokenizer.to_str(), encoding="utf-8")
    (out / "chat.json").write_text(json.dumps({"chat_template": codec.chat_template}), encoding="utf-8")
