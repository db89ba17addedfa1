"""Config fields that are also command-line flags: each default and help text is written once,
on its dataclass field, and the CLI's flags are derived from the fields.

`option(default, help)` declares a field; `add_flags(parser, cls)` adds one flag per option of
`cls` (`--field-name`; a bool defaulting to False is a switch, one defaulting to True is turned
off by the flag given as `flag`); `from_args(cls, args)` reads them back by name.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           default_factory: Any = dataclasses.MISSING, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a flag; `argparse_kwargs` (type, nargs, metavar...) go to
    `add_argument`."""
    meta = {"help": help, "flag": flag, "argparse": argparse_kwargs}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def add_flags(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in exclude:
            continue
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"], **meta["argparse"]}
        if isinstance(default, bool):
            kwargs["action"] = "store_false" if default else "store_true"
        else:
            kwargs["default"] = default
            if "type" not in kwargs and "nargs" not in kwargs and default is not None:
                kwargs["type"] = type(default)
        parser.add_argument(flag, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The values of `cls`'s options found in `args`, with `overrides` on top."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if "help" in f.metadata and hasattr(args, f.name)}
    return values | overrides
