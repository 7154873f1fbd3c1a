"""Loop classes: named loop budgets a request gets by name or by API key (`--loop-classes`).

A looped model's cost per token is its loops, so the loops a request may spend are a service
level: an `interactive` class may exit early and run few loops at high priority, a
`best-effort` one may use every loop at low priority. The server's `--loop-classes` is a JSON
object (inline, or a file's path):

    {"classes": {"interactive": {"exit_threshold": 0.3, "max_loops": 2, "priority": -1},
                 "standard": {"exit_threshold": 0.6},
                 "best-effort": {"exit_threshold": 1.0, "priority": 1}},
     "default": "standard",
     "api_keys": {"key-of-team-a": "interactive"}}

- A class sets any of `exit_threshold`, `min_loops`, `max_loops` (the request's loop bounds
  and threshold), `brownout_floor` (under the engine's overload brownout its tokens may run
  down to this many loops: `scheduler/brownout.py`) and `priority` (lower runs first under
  `--scheduling-policy priority`).
- A request picks its class with the `loop_class` field; otherwise the class of the API key
  it authenticated with (`api_keys`: these keys are accepted besides `--api-key`); otherwise
  `default` (none: the request gets no class). An unknown class is a 400 naming `loop_class`.
- The class's values fill the loop fields the request leaves unset (what the request sets
  wins, as with `--request-defaults`, which fill what is still unset after the class);
  its priority applies unless the client sets one (which needs `--allow-client-priority`).
- Responses name the class (`loop_class`) and report the loops used (`usage`); /metrics
  counts loop-tokens and requests per class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import SamplingParams

LOOP_FIELDS = ("exit_threshold", "min_loops", "max_loops", "brownout_floor")


@dataclass(frozen=True, slots=True)
class LoopClass:
    name: str
    exit_threshold: float | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    brownout_floor: int | None = None
    priority: int = 0

    def loop_fields(self) -> dict[str, Any]:
        """The loop fields the class sets."""
        values = {name: getattr(self, name) for name in LOOP_FIELDS}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class LoopClasses:
    classes: dict[str, LoopClass]
    default: str | None = None
    api_keys: tuple[tuple[str, str], ...] = ()  # (key, class)

    @classmethod
    def parse(cls, text: str) -> LoopClasses:
        """From JSON text or a JSON file's path; a ValueError says what is wrong."""
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as err:
                raise ValueError(f"cannot read {text}: {err}") from None
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not JSON: {err}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("classes"), dict):
            raise ValueError('needs an object with "classes": {name: {fields}}')
        unknown = sorted(set(raw) - {"classes", "default", "api_keys"})
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}")
        classes = {name: _loop_class(name, fields) for name, fields in raw["classes"].items()}
        default = raw.get("default")
        if default is not None and default not in classes:
            raise ValueError(f"default class {default!r} is not in classes")
        keys = raw.get("api_keys") or {}
        if not isinstance(keys, dict):
            raise ValueError('"api_keys" must map keys to class names')
        for key, name in keys.items():
            if name not in classes:
                raise ValueError(f"api key class {name!r} is not in classes")
            if not isinstance(key, str) or not key:
                raise ValueError("api keys must be non-empty strings")
        return cls(classes, default, tuple(keys.items()))

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.api_keys)

    def pick(self, requested: str | None, api_key: str | None) -> LoopClass | None:
        """The request's class: the one it names, its API key's, the default, or None."""
        if requested is not None:
            if requested not in self.classes:
                raise InvalidRequestError(
                    f"unknown loop_class {requested!r}; this server has "
                    + ", ".join(sorted(self.classes)),
                    param="loop_class",
                )
            return self.classes[requested]
        for key, name in self.api_keys:
            if api_key == key:
                return self.classes[name]
        return None if self.default is None else self.classes[self.default]


def _loop_class(name: str, fields: Any) -> LoopClass:
    if not isinstance(fields, dict):
        raise ValueError(f"class {name!r} must be an object of fields")
    unknown = sorted(set(fields) - {*LOOP_FIELDS, "priority"})
    if unknown:
        raise ValueError(f"class {name!r}: unknown field(s) {', '.join(unknown)}")
    loop_class = LoopClass(name, **fields)
    try:  # the same ranges a request's fields have
        SamplingParams(**loop_class.loop_fields())
    except (InvalidRequestError, TypeError) as err:
        raise ValueError(f"class {name!r}: {err}") from None
    if not isinstance(loop_class.priority, int) or isinstance(loop_class.priority, bool):
        raise ValueError(f"class {name!r}: priority must be an integer")
    return loop_class
