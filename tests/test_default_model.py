"""The embedded default model is the small trained Ouro checkpoint, and the README's demo
command prints English words with exit depths that vary from token to token."""

from __future__ import annotations

import re

from loopserve.llm import LLM
from loopserve.models.config import OuroConfig
from loopserve.models.tiny import DEFAULT_MODEL_DIR
from loopserve.sampling_params import SamplingParams
from loopserve.text.tokenizer import SPECIAL_TOKENS, Tokenizer

# The README quick start: loopserve generate --prompt "Once upon a time" with these settings.
DEMO_PROMPT = "Once upon a time"
DEMO_PARAMS = dict(max_tokens=48, temperature=0.6, top_p=0.9, seed=1, exit_threshold=0.5)

# Common English words (function words and frequent verbs), written down independently of
# the model and its training data.
COMMON_WORDS = set(
    "the a an and or but of to in on at for with from by as is are was were be been it its "
    "this that these those you your we our they their he she his her i me my can will would "
    "should could may not no yes if so than then there here what which who how when where "
    "all some more most many much other also just about into over after before have has had "
    "do does did make use help time people way new good one two first".split()
)


def test_default_checkpoint_is_a_small_trained_ouro_model():
    config = OuroConfig.from_file(DEFAULT_MODEL_DIR / "config.json")
    assert config.total_ut_steps == 4
    assert 256 <= config.hidden_size <= 384 and 2 <= config.num_hidden_layers <= 4
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= 12_000_000
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    assert [tokenizer.encode(t) for t in SPECIAL_TOKENS] == [[0], [1], [2]]
    assert tokenizer.vocab_size == config.vocab_size and tokenizer.has_chat_template


def test_readme_demo_prints_english_words_with_varying_exit_depths():
    llm = LLM(dtype="float32", num_blocks=64, block_size=16)
    (out,) = llm.generate([DEMO_PROMPT], SamplingParams(**DEMO_PARAMS), use_tqdm=False)
    assert len(out.token_ids) >= 16
    assert "\ufffd" not in out.text
    assert all(ch == "\n" or " " <= ch <= "~" for ch in out.text), repr(out.text)
    words = re.findall(r"[A-Za-z']+", out.text.lower())
    common = [w for w in words if w in COMMON_WORDS]
    assert len(set(common)) >= 4, out.text
    assert len(common) >= 0.25 * len(words), out.text
    assert len(set(out.exit_depths)) >= 2, out.exit_depths
    assert min(out.exit_depths) < 4, "threshold 0.5 never exited early"
