"""Text in and out of token ids: loading a tokenizer, chat templates, streaming detokenization.

`Tokenizer` wraps a Hugging Face `tokenizer.json` plus the small amount of metadata that lives
next to it (`tokenizer_config.json`, `generation_config.json`): end-of-sequence ids, the BOS
policy and the chat template. A checkpoint without `tokenizer.json` but with GPT-2-style files
(`vocab.json` + `merges.txt`, special tokens in `tokenizer_config.json`'s
`added_tokens_decoder`, `added_tokens.json` or `special_tokens_map.json`) gets the equivalent
byte-level BPE built from them. The streaming detokenizer lives in
`loopserve.text.detokenizer`, the toy tokenizer trainer in `loopserve.text.toy_tokenizer`.

This module does not tokenize in batches or apply sampling: stop *token* ids and EOS handling
belong to the engine; only stop *strings* are matched here, because they live in text space.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from loopserve.errors import InvalidRequestError, ModelLoadError
from loopserve.text.gpt2_files import gpt2_backend

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Tokens that end a chat turn in the common template families (ChatML, Llama 3, Phi, GPT-2).
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
# 256 byte symbols + 3 specials, plus enough merges that the vocabulary is more than bytes.
MIN_VOCAB_SIZE: int = 256 + len(SPECIAL_TOKENS) + 16
# Texts longer than this are encoded through `encode_batch`, which releases the GIL (plain
# `encode` holds it: a 4 MB prompt would freeze every other Python thread for seconds).
_GIL_FREE_ENCODE_CHARS = 8192


class Tokenizer:
    """A `tokenizers.Tokenizer` plus EOS ids, BOS policy and chat template.

    `add_bos_token=None` defers to the post-processor in `tokenizer.json` (how Llama-style
    tokenizers add BOS); True/False override it.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        generation_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._backend = backend
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template
        self._add_bos_token = add_bos_token
        self.bos_token_id = _token_id_or_none(backend, bos_token)
        eos_id = _token_id_or_none(backend, eos_token)
        candidates = (*generation_eos_token_ids, *(() if eos_id is None else (eos_id,)))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(candidates))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special_ids.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            special_ids.add(self.bos_token_id)
        self.special_token_ids: frozenset[int] = frozenset(special_ids)
        turn_ids = (_token_id_or_none(backend, token) for token in END_OF_TURN_TOKENS)
        self.end_of_turn_token_ids: tuple[int, ...] = tuple(i for i in turn_ids if i is not None)
        self._compiled_template: jinja2.Template | None = None
        # The text of every special token, and a copy of the backend that encodes such text
        # as plain text (made on first use): what message contents are encoded with.
        self.special_texts: tuple[str, ...] = tuple(
            t.content for t in backend.get_added_tokens_decoder().values() if t.special
        )
        self._plain_backend: tokenizers.Tokenizer | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer | None:
        """Load the tokenizer saved in checkpoint directory `path`; None if it has none."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        config = _read_json(directory / "tokenizer_config.json")
        if tokenizer_file.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
            except Exception as exc:  # the Rust loader raises plain Exception on bad files
                raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            added_tokens = _read_json(directory / "added_tokens.json")
            backend = gpt2_backend(directory, config, added_tokens)
            # `special_tokens_map.json` names EOS/BOS where the config leaves them out or null.
            special_map = _read_json(directory / "special_tokens_map.json")
            for key in ("eos_token", "bos_token"):
                if config.get(key) is None and special_map.get(key) is not None:
                    config = {**config, key: special_map[key]}
        else:
            return None
        generation = _read_json(directory / "generation_config.json")
        chat_template = _chat_template_from(config.get("chat_template"))
        template_file = directory / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        add_bos_token = config.get("add_bos_token")
        return cls(
            backend,
            eos_token=_token_content(config.get("eos_token")),
            bos_token=_token_content(config.get("bos_token")),
            chat_template=chat_template,
            add_bos_token=None if add_bos_token is None else bool(add_bos_token),
            generation_eos_token_ids=_int_tuple(generation.get("eos_token_id")),
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is added when the model wants it."""
        defer_to_backend = add_special_tokens and self._add_bos_token is None
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            batch = self._backend.encode_batch([text], add_special_tokens=defer_to_backend)
            token_ids = batch[0].ids
        else:
            token_ids = self._backend.encode(text, add_special_tokens=defer_to_backend).ids
        if add_special_tokens and self._add_bos_token and self.bos_token_id is not None:
            token_ids.insert(0, self.bos_token_id)
        return token_ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        check_text: Callable[[str], None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat prompt of `messages` (text, token ids). Text in a message's content that
        spells a special token (`<|im_end|>`, ...) is encoded as plain text, never as the
        control token: a user cannot forge a turn. A prompt whose contents spell none is
        encoded as a whole, as before; one whose contents do is encoded in pieces: the
        template's text between the contents with special tokens, each content without.
        `check_text(text)` runs on the rendered prompt before anything is encoded. `tools`:
        the template's `tools` variable (for a template that renders tools)."""
        render = functools.partial(
            self.apply_chat_template, add_generation_prompt=add_generation_prompt, tools=tools
        )
        text = render(messages)
        if check_text is not None:
            check_text(text)
        specials = self.special_texts
        if not any(special in m["content"] for m in messages for special in specials):
            return text, self.encode(text)
        marks = [_CONTENT_MARK.format(i) for i in range(len(messages))]
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
        rendered = render(marked)
        pieces = _CONTENT_MARK_PATTERN.split(rendered)  # template, index, template, index, ...
        indices = [int(index) for index in pieces[1::2]]
        contents = [m["content"] for m in messages]
        in_order = indices == list(range(len(messages)))
        if not in_order or text != "".join(
            contents[int(p)] if i % 2 else p for i, p in enumerate(pieces)
        ):
            # The template dropped, repeated, reordered or rewrote (trimmed, ...) a content.
            raise InvalidRequestError(
                "a message spells a special token, and this model's chat template does not "
                "place each message's content once, in order and unchanged, so it cannot be "
                "kept plain text",
                param="messages",
            )
        token_ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                token_ids += self.encode(piece) if piece else []
            else:
                token_ids += self._encode_plain(contents[int(piece)])
        return text, token_ids

    def backend_json(self) -> str:
        """The `tokenizers` backend as its JSON (what other libraries load it from)."""
        return self._backend.to_str()

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token text taken as plain text."""
        if self._plain_backend is None:
            plain = tokenizers.Tokenizer.from_str(self.backend_json())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend.encode(text, add_special_tokens=False).ids if text else []

    def use_chat_template(self, chat_template: str) -> None:
        """Render chat requests with `chat_template` (a template's text, as
        `read_chat_template` gives it) instead of the checkpoint's."""
        self.chat_template = chat_template
        self._compiled_template = None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` into a prompt string (`tools`: the template's `tools` variable,
        left undefined when None); malformed input raises InvalidRequestError."""
        _check_messages(messages)
        template = self._template()
        extra = {} if tools is None else {"tools": tools}
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except InvalidRequestError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise InvalidRequestError(
                f"chat template failed to render: {exc}", param="messages"
            ) from exc

    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use the completions API",
                param="messages",
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = _template_environment().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise InvalidRequestError(
                    f"chat template does not compile: {exc}", param="messages"
                ) from exc
        return self._compiled_template

    @property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary entry (added tokens included).

        A byte-level entry spells one character per byte, so it is never shorter than the text
        it decodes to: a prompt of more than `n * max_token_chars` characters needs more than
        `n` tokens, unless a normalizer deletes characters (none of the usual ones do).
        """
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)


def is_jinja(text: str) -> bool:
    """`text` reads as a Jinja template (an expression or a statement in it), not a path."""
    return "{{" in text or "{%" in text


def read_chat_template(value: str) -> str:
    """The chat template `value` names (the `chat_template` engine argument, `--chat-template`,
    as vLLM's takes it): a file's text when `value` is an existing file's path, else `value`
    itself when it is Jinja; one that does not compile, or a path that is no file, is a
    `ConfigError` naming it (before the engine or the server starts)."""
    from loopserve.errors import ConfigError

    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"chat_template: cannot read {path}: {exc}") from exc
    elif is_jinja(value):
        text = value
    else:
        raise ConfigError(
            f"chat_template {value!r} is neither a file nor a Jinja template (no {{{{ or {{%)"
        )
    try:
        _template_environment().from_string(text)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"chat_template does not compile: {exc}") from exc
    return text


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # Hugging Face templates expect tojson without HTML escaping and with unicode kept.
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    return env


def _raise_template_exception(message: str) -> None:
    raise InvalidRequestError(message, param="messages")


# Placeholders for message contents (private-use characters no tokenizer gives meaning to).
_CONTENT_MARK = "\ue000{}\ue001"
_CONTENT_MARK_PATTERN = re.compile("\ue000(\\d+)\ue001")


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(
                    f"messages[{index}].{key} must be a string", param="messages"
                )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_content(token: object) -> str | None:
    """A special token given as a string or as an AddedToken dict `{"content": ...}`."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template_from(value: object) -> str | None:
    """A template string, or the "default" entry of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _int_tuple(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _token_id_or_none(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


__all__ = [
    "CHATML_TEMPLATE",
    "END_OF_TURN_TOKENS",
    "MIN_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "Tokenizer",
]
