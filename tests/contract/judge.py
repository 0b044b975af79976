"""SGLang's own code as a judge, in a subprocess: `python judge.py <unpacked wheel dir>`, JSON lines in and out.

One process per SGLang version (two versions of a package cannot share an interpreter). Nothing of SGLang
is copied into this repository: the wheel is downloaded at test time (`conftest.py`) and imported here.

Stand-ins: this project's venv has no GPU stack, and SGLang imports it at module level even where the code
under test never touches it. `STAND_INS` lists the modules replaced by an empty stand-in (every attribute is
another stand-in; calling one returns it; `triton`'s device query raises, i.e. "no GPU"):
- GPU-only: torch, triton, torchvision;
- SGLang dependencies this project does not install, used by the imported modules only in paths the
  judge does not run: PIL (images), zmq (IPC), pybase64, orjson, IPython, aiohttp, sentencepiece,
  partial_json_parser (streaming tool-call JSON), openai (only its Responses-API types).
`sglang/__init__.py` (the frontend language, HF patches) is skipped: `sglang` is registered as a bare
package. `SGLANG_USE_CPU_ENGINE=1` picks SGLang's CPU platform instead of probing for accelerators.

Ops (one JSON object per line): {"op": "parse_argv", "argv": [...]}, {"op": "validate", "model": "...",
"data": {...}}, {"op": "reasoning", "text": "...", "force": true}, {"op": "tools", "text": "...",
"tools": [...]}, {"op": "source_contains", "path": "...", "text": "..."}, {"op": "flags"}.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import sys
import types
from pathlib import Path

STAND_INS = {"torch", "triton", "torchvision", "PIL", "zmq", "pybase64", "orjson", "IPython", "aiohttp",
             "sentencepiece", "partial_json_parser", "openai"}
RAISES = {"triton.runtime.driver.active.get_current_target"}  # "which GPU?" -> none
ABSENT = {"npu", "xpu", "hpu", "musa", "mlu"}  # torch.<backend> that must not appear to exist


def _any_schema(cls, source, handler):
    from pydantic_core import core_schema

    return core_schema.any_schema()


class _StandInType(abc.ABCMeta):
    """A stand-in class: attributes are stand-ins, calls return it (or decorate), it is empty and falsy."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if "_stand_in" not in cls.__dict__:
            return super().__call__(*args, **kwargs)
        if cls.__qualname__ in RAISES:
            raise RuntimeError(f"{cls.__qualname__}: no GPU here")
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return cls

    def register(cls, *args, **kwargs):
        return args[-1] if args else None

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __contains__(cls, item):
        return False

    def __len__(cls):
        return 0

    def __int__(cls):
        return 0

    __index__ = __int__

    def __float__(cls):
        return 0.0

    def __lt__(cls, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(cls, other):
        return cls is other

    def __hash__(cls):
        return id(cls)


def _stand_in(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return _StandInType(name, (), {"__qualname__": qualname, "__module__": module, "_stand_in": True,
                                   "__init_subclass__": classmethod(lambda cls, **kw: None),
                                   "__get_pydantic_core_schema__": classmethod(_any_schema)})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name == "__version__":
            return "2.9.1"  # recent enough for every version check on the way
        if name in ABSENT or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        child = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(root: Path) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.meta_path.insert(0, _Finder())
    package = types.ModuleType("sglang")
    package.__path__ = [str(root / "sglang")]
    sys.modules["sglang"] = package
    sys.path.insert(0, str(root))


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_argv(argv: list[str]) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = _parser().parse_args(argv)
    except SystemExit as exc:
        return {"exit": exc.code, "stderr": err.getvalue()}
    return {"exit": 0, "args": {k: v for k, v in vars(ns).items() if isinstance(v, str | int | float | bool)
                                or v is None}}


def validate(model: str, data: dict) -> dict:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai import protocol

    cls = getattr(protocol, model)
    try:
        obj = cls.model_validate(data)
    except ValidationError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "fields": sorted(cls.model_fields), "dump": obj.model_dump(mode="json")}


def reasoning(text: str, force: bool) -> dict:
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    parser = ReasoningParser(model_type="qwen3", stream_reasoning=False, force_reasoning=force)
    reasoning_text, normal_text = parser.parse_non_stream(text)
    return {"reasoning": reasoning_text, "content": normal_text}


def tools(text: str, tool_specs: list[dict]) -> dict:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector

    result = Qwen3CoderDetector().detect_and_parse(text, [Tool.model_validate(t) for t in tool_specs])
    return {"content": result.normal_text,
            "calls": [{"name": c.name, "arguments": json.loads(c.parameters)} for c in result.calls]}


def main() -> None:
    install(Path(sys.argv[1]))
    out = sys.stdout
    sys.stdout = sys.stderr  # SGLang's import-time prints must not corrupt the protocol
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "parse_argv":
                res = parse_argv(req["argv"])
            elif op == "validate":
                res = validate(req["model"], req["data"])
            elif op == "reasoning":
                res = reasoning(req["text"], req["force"])
            elif op == "tools":
                res = tools(req["text"], req["tools"])
            elif op == "flags":
                res = {"flags": sorted(o for a in _parser()._actions for o in a.option_strings)}
            elif op == "source_contains":
                res = {"found": req["text"] in (Path(sys.argv[1]) / req["path"]).read_text()}
            else:
                res = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the test, which fails with it
            res = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
