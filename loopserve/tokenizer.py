"""Text in and out of token ids: loading a tokenizer, chat templates, streaming detokenization.

`Tokenizer` wraps a Hugging Face `tokenizer.json` plus the small amount of metadata that lives
next to it (`tokenizer_config.json`, `generation_config.json`): end-of-sequence ids, the BOS
policy and the chat template. `IncrementalDetokenizer` turns one request's output ids into text
piece by piece, holding back partial UTF-8 characters and possible stop-string prefixes.
`write_byte_level_bpe_tokenizer` trains a tiny byte-level BPE tokenizer on an embedded corpus, so
tests and toy checkpoints need no download.

This module does not tokenize in batches or apply sampling: stop *token* ids and EOS handling
belong to the engine; only stop *strings* are matched here, because they live in text space.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from loopserve.errors import InvalidRequestError, ModelLoadError

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
# Prompt tokens decoded as left context for the first output token (vLLM uses the same 5), so
# tokenizers that drop a leading space at the start of a decode keep it between prompt and output.
_NUM_PROMPT_CONTEXT_TOKENS = 5

_CORPUS = """\
The quick brown fox jumps over the lazy dog. This sentence uses every letter of the alphabet,
and for that reason it has been used for many years to test typewriters and computer fonts.

A language model reads a sequence of tokens and predicts the next one. A looped language model
applies the same stack of layers more than once before it makes that prediction. Each pass over
the stack is called a loop. Some tokens are easy and need only one or two loops; other tokens are
hard and need all of them. When the model is confident, it may exit early and save compute.

On Monday, March 3rd, 2025, the team met at 9:30 in the morning. They had 12 tasks, 4 engineers
and 1 deadline. "Can we finish by Friday?" asked the manager. "Yes, if nothing breaks," said
the lead. It was not a promise; it was a plan. By 5:45 p.m. they had closed 7 of the 12 tasks.

Numbers appear everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 512, 1024, 2048,
3.14159, 2.71828, 1,000,000 and -17. Prices are written as $19.99 or 45%; times as 12:00;
dates as 2024-06-30; versions as v1.2.3; and ratios as 3/4 or 16:9.

Good software is simple to read. Write small functions that do one thing. Name things for what
they are, not for how they are built. Test the behaviour you promise, and keep the tests fast.
When something fails, the error message should say what went wrong and how to fix it. Comments
should explain why the code is the way it is, because the code itself already says what it does.

The weather today is cold and wet. Rain fell all night, and the river is high. The children
stayed inside, read books, played games and drank hot chocolate. In the evening the sky cleared,
the wind dropped, and the first stars came out over the hills. Tomorrow should be warm and dry.

Questions and answers:
Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a week?
A: There are seven days in a week.
Q: Who wrote the play Hamlet?
A: William Shakespeare wrote it, around the year 1600.

A small cafe on the corner sells coffee, tea, bread and soup. Its owner, a naive but kind man
from Zurich, opens at 7 and closes at 19. People say the café is the best in town; the crème
brûlée is famous, and the piñata at the party was a hit. Everyone is welcome, they say, and
nobody leaves hungry.

Lists help the reader:
- first, gather the data;
- second, clean it and check it;
- third, train the model;
- finally, measure the results and write them down.

(Parentheses), [brackets], {braces}, <angle brackets>, 'single quotes', "double quotes",
back\\slashes, under_scores, hyphen-ated words, and email@example.com are all part of text too!
Is that right? Yes! No... maybe; perhaps: who knows?
"""


def write_byte_level_bpe_tokenizer(path: str | os.PathLike[str], *, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it into directory `path`.

    Writes `tokenizer.json`, `tokenizer_config.json` (ChatML template, EOS `<|im_end|>`) and
    `generation_config.json`; other files in `path` are left alone. `vocab_size` counts the
    special tokens, the 256 byte symbols and the merges. The output is deterministic.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the embedded corpus supports at most {backend.get_vocab_size()} tokens, "
            f"got vocab_size={vocab_size}"
        )
    special_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    assert list(special_ids.values()) == list(range(len(SPECIAL_TOKENS))), special_ids
    eos_token, pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in special_ids.items()
        },
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (eos_token, pad_token)],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_max_length": 32768,
        "pad_token": pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    generation_config = {
        "eos_token_id": [special_ids[eos_token], special_ids[pad_token]],
        "bos_token_id": None,
    }
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)


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

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer | None:
        """Load the tokenizer saved in checkpoint directory `path`; None if it has none."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises plain Exception on bad files
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
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
        token_ids = self._backend.encode(text, add_special_tokens=defer_to_backend).ids
        if add_special_tokens and self._add_bos_token and self.bos_token_id is not None:
            token_ids.insert(0, self.bos_token_id)
        return token_ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` into a prompt string; malformed input raises InvalidRequestError."""
        _check_messages(messages)
        template = self._template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
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


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one output token released: text safe to stream now, and the stop string it hit."""

    new_text: str
    stop_hit: str | None = None


class IncrementalDetokenizer:
    """Streams one request's output text, decoding only a small window of recent tokens.

    The window (vLLM's prefix/read offsets) is `window_ids`: the tokens read last time (at first,
    up to 5 prompt tokens as context) followed by the unread ones from `read_offset` on.
    Invariant: `prefix_text` is the decode of `window_ids[:read_offset]`, already in `text` for
    output tokens; new text is the window's decode past it. Text is read only when the window
    does not end in U+FFFD (a partial UTF-8 character), and released only up to the longest tail
    that could still grow into a stop string. Tokens added after a stop string hit are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context_ids)
        if context_text.endswith("\ufffd"):
            # The prompt ends mid-character; its bytes must not swallow the output's first ones.
            context_ids, context_text = [], ""
        self._window_ids = context_ids
        self._read_offset = len(context_ids)
        self._prefix_text = context_text
        self._text = ""
        self._num_released_chars = 0
        self._stop_hit: str | None = None

    @property
    def text(self) -> str:
        """All output text so far, excluding a matched stop string and anything after it."""
        return self._text

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text (found by add_token or finish), or None."""
        return self._stop_hit

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        """Read one output token; return the text it made safe to stream and any stop hit."""
        if self._stop_hit is not None:
            return DetokenizerUpdate("")
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return DetokenizerUpdate("")
        self._advance(window_text)
        stop_hit = self._stop_hit
        return DetokenizerUpdate(self._release(final=stop_hit is not None), stop_hit)

    def finish(self) -> str:
        """Release everything held back, partial characters included (as U+FFFD)."""
        if self._stop_hit is None:
            window_text = self._decode(self._window_ids)
            if len(window_text) > len(self._prefix_text):
                self._advance(window_text)
        return self._release(final=True)

    def _advance(self, window_text: str) -> None:
        """Append the window's new text, move the offsets, and cut at the first stop string."""
        num_old_chars = len(self._text)
        self._text += window_text[len(self._prefix_text) :]
        # The new prefix is what was just read; older tokens are never decoded again.
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids)
        if not self._stop:
            return
        # A new match must end in the new text, so it starts at most max_len - 1 chars earlier.
        search_from = max(0, num_old_chars - self._max_stop_chars + 1)
        matches = [(self._text.find(s, search_from), s) for s in self._stop]
        found = [(start, s) for start, s in matches if start >= 0]
        if found:
            start, self._stop_hit = min(found, key=lambda match: match[0])
            assert start >= self._num_released_chars, "released text overlaps a stop string"
            self._text = self._text[:start]

    def _release(self, *, final: bool) -> str:
        held_chars = 0 if final else self._stop_prefix_chars()
        end = max(self._num_released_chars, len(self._text) - held_chars)
        new_text = self._text[self._num_released_chars : end]
        self._num_released_chars = end
        return new_text

    def _stop_prefix_chars(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for num_chars in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:num_chars]):
                    longest = num_chars
                    break
        return longest

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


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
