"""How client commands print a response: proto JSON with `--json`, a readable line otherwise."""

from __future__ import annotations

import argparse
import json
from typing import Any

from google.protobuf import json_format

__all__ = ["output"]


def output(args: argparse.Namespace, response: Any, text: str) -> int:
    """Print `response` as JSON (field names as in the proto) or `text`; the exit code is 0."""
    if args.json:
        print(json.dumps(json_format.MessageToDict(response, preserving_proto_field_name=True)))
    else:
        print(text)
    return 0
