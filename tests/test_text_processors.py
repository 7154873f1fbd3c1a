"""Text at the edges: the input processor (checks, pre-checks, tokenization), incremental stop
strings against a naive search, the stop-string limits, finish reasons, GPT-2 tokenizer files."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers

from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.llm import LLM
from loopserve.sampling_params import SamplingParams
from loopserve.text.detokenizer import IncrementalDetokenizer
from loopserve.text.input_processor import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    InputProcessor,
    ProcessedPrompt,
)
from loopserve.text.tokenizer import Tokenizer
from loopserve.text.toy_tokenizer import write_byte_level_bpe_tokenizer

VARIED_TEXT = (
    "The quick brown fox, café crème brûlée 😀🚀 日本語 Ωμέγα <|im_start|>user\n"
    "Hi there!<|im_end|>\n  tabs\tand   spaces 3.14159 <|endoftext|> naïve"
)
WORDS = ["the", " loop", " model", " café", " 日本", "語", " 😀", "!", "\n", " ab", "ba", " Ωμ"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("toy_tokenizer")
    write_byte_level_bpe_tokenizer(path, vocab_size=512)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    loaded = Tokenizer.from_dir(tokenizer_dir)
    assert loaded is not None
    return loaded


def write_gpt2_files(tokenizer_dir: Path, out: Path) -> None:
    """vocab.json + merges.txt (saved from the BPE model) + tokenizer_config.json; no
    tokenizer.json."""
    out.mkdir(parents=True, exist_ok=True)
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    backend.model.save(str(out))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "tokenizer.json").unlink(missing_ok=True)


# --- input processor --------------------------------------------------------------------------


def test_string_prompt_is_tokenized_and_ids_are_checked(tokenizer: Tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=64)
    processed = processor.process("the loop")
    assert processed == ProcessedPrompt("the loop", tokenizer.encode("the loop"))
    assert processor.process([5, 6]) == ProcessedPrompt(None, [5, 6])
    with pytest.raises(InvalidRequestError, match=r"out of range \[0, 512\): \[512\]"):
        processor.process([1, 512])
    with pytest.raises(InvalidRequestError, match="at least one token"):
        processor.process([])
    with pytest.raises(CapacityError, match="64 tokens"):
        processor.process(list(range(64)))


def test_too_many_characters_are_rejected_before_tokenizing(
    tokenizer_dir: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=100)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    longest = max(len(token) for token in vocab)
    limit = 99 * longest
    assert processor.max_prompt_chars == limit

    def no_encoding(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("the pre-check must reject before tokenizing")

    monkeypatch.setattr(tokenizer, "encode", no_encoding)
    with pytest.raises(CapacityError, match=f"{limit + 1} characters") as info:
        processor.process("a" * (limit + 1))
    assert info.value.param == "prompt"
    messages = [{"role": "user", "content": "b" * (limit + 1)}]
    with pytest.raises(CapacityError, match="characters") as info:
        processor.process_chat(messages)
    assert info.value.param == "messages"


def test_prompt_at_the_character_limit_reaches_the_tokenizer(tokenizer: Tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=100)
    text = "a" * processor.max_prompt_chars
    num_tokens = len(tokenizer.encode(text))
    # Not the character pre-check: the token count, known only after tokenizing.
    with pytest.raises(CapacityError, match=f"the prompt has {num_tokens} tokens"):
        processor.process(text)


def test_long_prompts_encode_the_same_through_the_gil_free_path(tokenizer: Tokenizer) -> None:
    unit = VARIED_TEXT + "\n"
    text = unit * 200  # over the length where `encode` switches to `encode_batch`
    short_ids = tokenizer.encode(unit)
    assert len(text) > 8192 and tokenizer.encode(text) == short_ids * 200


def test_chat_prompt_is_rendered_and_tokenized_without_extra_specials(tokenizer: Tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=4096)
    processed = processor.process_chat([{"role": "user", "content": "Hi"}])
    expected_text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert processed.text == expected_text
    assert processed.token_ids == tokenizer.encode(expected_text)
    assert processed.token_ids[0] == 1  # <|im_start|>


def test_no_tokenizer_rejects_text_but_takes_ids() -> None:
    processor = InputProcessor(None, vocab_size=10, max_model_len=8)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        processor.process("text")
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        processor.process_chat([{"role": "user", "content": "x"}])
    assert processor.process([1, 2]).token_ids == [1, 2]


def test_prompt_plus_max_tokens_must_fit(tokenizer: Tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=10)
    processor.check_request(ProcessedPrompt(None, [1] * 6), SamplingParams(max_tokens=4))
    with pytest.raises(CapacityError, match="= 11 exceeds the maximum context length 10"):
        processor.check_request(ProcessedPrompt(None, [1] * 6), SamplingParams(max_tokens=5))


# --- stop-string limits -----------------------------------------------------------------------


def test_stop_string_limits_are_enforced(tokenizer: Tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=512, max_model_len=4096)
    prompt = ProcessedPrompt(None, [5])
    ok = [f"s{i}" for i in range(32)]
    processor.check_request(prompt, SamplingParams(stop=ok))
    assert MAX_STOP_STRINGS == 32 and MAX_STOP_STRING_CHARS == 2048
    many = [f"stop{i}" for i in range(30_000)]
    with pytest.raises(InvalidRequestError, match="too many stop strings: 30000") as info:
        processor.check_request(prompt, SamplingParams(stop=many))
    assert info.value.param == "stop"
    long = ["x" * 1025, "y" * 1024]
    with pytest.raises(InvalidRequestError, match="2049 characters") as info:
        processor.check_request(prompt, SamplingParams(stop=long))
    assert info.value.param == "stop"


def test_engine_rejects_30000_stop_strings_and_stays_clean(tiny_tok_dir: Path) -> None:
    llm = LLM(model=str(tiny_tok_dir), dtype="float32", num_blocks=64)
    params = SamplingParams(max_tokens=4, stop=[f"stop{i}" for i in range(30_000)])
    with pytest.raises(InvalidRequestError, match="too many stop strings"):
        llm.generate(["the loop", "a model"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == 64


# --- incremental stop-string matching ---------------------------------------------------------


def naive_stop(
    tokenizer: Tokenizer, token_ids: list[int], stops: list[str]
) -> tuple[str, str | None]:
    """Decode the whole prefix after every token and search all of it for every stop string;
    the first token whose text contains a stop ends the text at the earliest such start."""
    for num_tokens in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:num_tokens])
        hits = [(text.find(stop), i, stop) for i, stop in enumerate(stops) if stop in text]
        if hits:
            start, _, stop = min(hits)
            return text[:start], stop
    return tokenizer.decode(token_ids), None


def test_incremental_stop_matching_equals_naive_full_text_search(tokenizer: Tokenizer) -> None:
    rng = random.Random(20261130)
    num_spanning = num_hits = 0
    for _ in range(300):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25)))
        token_ids = tokenizer.encode(text)
        stops = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.8:
                start = rng.randrange(len(text))
                stops.append(text[start : start + rng.randint(1, 8)])
            else:
                stops.append(rng.choice(["zzz", "qq", "Ω!", "😀😀😀"]))
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), stop=stops)
        pieces = []
        for token_id in token_ids:
            update = detokenizer.add_token(token_id)
            pieces.append(update.new_text)
            if update.stop_hit is not None:
                break
            # Held back: exactly the longest tail that is a proper prefix of some stop string.
            text_so_far = detokenizer.text
            held = max(
                (n for s in stops for n in range(1, len(s)) if text_so_far.endswith(s[:n])),
                default=0,
            )
            assert "".join(pieces) == text_so_far[: len(text_so_far) - held]
        else:
            pieces.append(detokenizer.finish())
        expected_text, expected_stop = naive_stop(tokenizer, token_ids, stops)
        assert "".join(pieces) == detokenizer.text == expected_text, (text, stops)
        assert detokenizer.stop_hit == expected_stop, (text, stops)
        if expected_stop is not None:
            num_hits += 1
            boundaries = {len(tokenizer.decode(token_ids[:k])) for k in range(len(token_ids))}
            end = len(expected_text) + len(expected_stop)
            if any(len(expected_text) < b < end for b in boundaries):
                num_spanning += 1
    assert num_hits >= 150 and num_spanning >= 50, (num_hits, num_spanning)


# --- finish reasons ---------------------------------------------------------------------------


def test_stop_string_finishes_through_scheduler_and_length_keeps_its_reason(
    tiny_tok_dir: Path,
) -> None:
    llm = LLM(model=str(tiny_tok_dir), dtype="float32", num_blocks=64)
    greedy = dict(temperature=0.0, ignore_eos=True)
    free = llm.generate("the loop", SamplingParams(max_tokens=8, **greedy), use_tqdm=False)[0]
    tokenizer = llm.tokenizer
    # A one-character stop string first completed by output token k (k >= 2).
    texts = [tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    k, stop = next(
        (k, texts[k][-1])
        for k in range(2, len(texts))
        if texts[k] and texts[k][-1] != "\ufffd" and texts[k][-1] not in texts[k - 1]
    )
    out = llm.generate("the loop", SamplingParams(max_tokens=8, stop=[stop], **greedy))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.token_ids[:k]
    assert out.text == texts[k][:-1]
    assert llm.engine.scheduler.kv.num_free_blocks == 64
    # The same stop on the max_tokens-th token: the scheduler finished it first ("length").
    capped = llm.generate("the loop", SamplingParams(max_tokens=k, stop=[stop], **greedy))[0]
    assert capped.finish_reason == "length" and capped.stop_reason == stop
    assert capped.text == out.text and capped.token_ids == out.token_ids


# --- GPT-2-style tokenizer files --------------------------------------------------------------


def test_gpt2_files_encode_and_decode_like_tokenizer_json(
    tokenizer_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    write_gpt2_files(tokenizer_dir, tmp_path / "gpt2")
    assert sorted(p.name for p in (tmp_path / "gpt2").iterdir()) == [
        "generation_config.json",
        "merges.txt",
        "tokenizer_config.json",
        "vocab.json",
    ]
    gpt2 = Tokenizer.from_dir(tmp_path / "gpt2")
    assert gpt2 is not None
    ids = tokenizer.encode(VARIED_TEXT)
    assert ids.count(1) == 1 and ids.count(2) == 1 and ids.count(0) == 1  # specials are single
    assert gpt2.encode(VARIED_TEXT) == ids
    assert gpt2.decode(ids, skip_special_tokens=False) == VARIED_TEXT
    assert gpt2.decode(ids) == tokenizer.decode(ids)
    assert gpt2.eos_token_ids == tokenizer.eos_token_ids == (2, 0)
    assert gpt2.special_token_ids == tokenizer.special_token_ids
    assert gpt2.vocab_size == tokenizer.vocab_size == 512


def test_gpt2_added_tokens_outside_the_vocab_get_their_ids(
    tokenizer_dir: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    out = tmp_path / "gpt2"
    write_gpt2_files(tokenizer_dir, out)
    (out / "added_tokens.json").write_text(json.dumps({"<|tool|>": 512}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    gpt2 = Tokenizer.from_dir(out)
    assert gpt2 is not None
    assert gpt2.encode("a<|tool|>b") == [*tokenizer.encode("a"), 512, *tokenizer.encode("b")]
    assert gpt2.bos_token == "<|im_start|>" and gpt2.bos_token_id == 1
    (out / "added_tokens.json").write_text(json.dumps({"<|tool|>": 600}))
    with pytest.raises(Exception, match="should have id 600"):
        Tokenizer.from_dir(out)


def test_checkpoint_with_only_gpt2_files_accepts_text_prompts(
    tiny_tok_dir: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "gpt2_ckpt"
    shutil.copytree(tiny_tok_dir, checkpoint)
    (checkpoint / "tokenizer.json").unlink()
    write_gpt2_files(tiny_tok_dir, checkpoint)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gpt2_out = LLM(model=str(checkpoint), dtype="float32", num_blocks=64).generate(
        "The quick brown fox", params, use_tqdm=False
    )[0]
    json_out = LLM(model=str(tiny_tok_dir), dtype="float32", num_blocks=64).generate(
        "The quick brown fox", params, use_tqdm=False
    )[0]
    assert gpt2_out.prompt_token_ids == json_out.prompt_token_ids
    assert gpt2_out.token_ids == json_out.token_ids and len(gpt2_out.token_ids) == 6
    assert gpt2_out.text == json_out.text
