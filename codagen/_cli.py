"""What the ``codagen`` commands share: help text from RST docstrings, the checked ``--dtype`` and
``--device`` arguments (a bad value is a one-line usage error naming the argument) and model preset names
(``llama3-8b``; ``llama3_8b`` is read as the same name)."""
from __future__ import annotations

import argparse
import re

import torch

__all__ = ["command_parser", "plain_text", "dtype_arg", "device_arg", "preset_name", "preset_arg", "DTYPES"]

#: ``--dtype`` spellings: the short names the docs use and torch's own
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|ref|doc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_INTERPRETED = re.compile(r"`([^`]+)`")
_DIRECTIVE = re.compile(r"^\s*\.\. [\w-]+::.*\n", re.MULTILINE)  # ``.. code::``: the indented lines stay
_LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)  # "Schema::" introduces an indented block


def plain_text(doc: str) -> str:
    """``doc`` without RST markup (``literals``, :func:`roles`, `interpreted text`, directives, literal-block
    ``::``, escaped backslashes), for a terminal."""
    text = _DIRECTIVE.sub("", doc)
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _LITERAL_BLOCK.sub(r"\1:", text)
    return text.replace("\\\\", "\\").strip("\n")


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of one ``codagen`` command, its module docstring as plain-text help."""
    return argparse.ArgumentParser(prog=prog, description=plain_text(doc or ""),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def dtype_arg(*allowed: str):
    """An argparse ``type`` that maps a dtype name (``bf16`` or ``bfloat16``, ...) to a ``torch.dtype``;
    ``allowed``: the dtypes the command takes (torch names)."""
    def parse(text: str) -> torch.dtype:
        dtype = DTYPES.get(text.strip().lower())
        if dtype is None or str(dtype).removeprefix("torch.") not in allowed:
            names = [n for n, d in DTYPES.items() if str(d).removeprefix("torch.") in allowed]
            raise argparse.ArgumentTypeError(f"expected one of {names}, got {text!r}")
        return dtype
    parse.__name__ = "dtype"  # argparse names the type in its error message
    return parse


def device_arg(text: str) -> torch.device:
    """An argparse ``type``: a torch device that exists on this machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected 'cpu' or a CUDA device, got {text!r}")
    return device


def preset_name(text: str) -> str:
    """The canonical spelling of a model preset name: lower case, hyphens (``llama3_8b`` -> ``llama3-8b``)."""
    return text.strip().lower().replace("_", "-")


def preset_arg(names):
    """An argparse ``type`` for a preset of ``names`` (canonical spellings), in either spelling."""
    def parse(text: str) -> str:
        name = preset_name(text)
        if name not in names:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
        return name
    parse.__name__ = "preset"  # argparse names the type in its error message
    return parse
