"""The CLI's own parsing: --lora-modules entries and the two subcommands."""

from __future__ import annotations

import argparse

import pytest

from pyserve.cli import build_parser, lora_module
from pyserve.default_model import ADAPTER_DIRS


def test_lora_module_takes_name_equals_path_or_an_embedded_short_name():
    assert lora_module("mine=/srv/a=b") == ("mine", "/srv/a=b")
    assert lora_module("tests") == ("tests", str(ADAPTER_DIRS["tests"]))
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=PATH"):
        lora_module("nope")


def test_batch_needs_its_files_and_serve_its_address():
    args = build_parser().parse_args(["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--max-num-seqs", "8"])
    assert (args.input, args.output, args.max_num_seqs, args.served_model_name) == ("in.jsonl", "out.jsonl", 8, None)
    args = build_parser().parse_args(["serve", "--port", "9000", "--lora-modules", "tests"])
    assert (args.host, args.port, args.lora_modules) == ("127.0.0.1", 9000, [("tests", str(ADAPTER_DIRS["tests"]))])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["batch", "--input", "in.jsonl"])
