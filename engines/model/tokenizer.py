"""The policy tokenizer: a byte-level BPE trained here, on the repo's own corpus, in seconds.

Pipeline (exactly Qwen2's): NFC normalization; a Split on the Qwen2/GPT-4 regex (digits one by one,
words with their leading space), then ByteLevel mapping bytes to printable characters; BPE over
those; a ByteLevel decoder back to bytes. The 256 byte symbols are always in the vocabulary, so any
text encodes, and decodes to its NFC form: NFC text (ASCII, code, precomposed accents, CJK, emoji)
comes back byte for byte; a decomposed "e" + U+0301 comes back as the composed "é".

Why NFC and not no normalization at all: for a ``qwen2`` model, transformers 5's AutoTokenizer
ignores tokenizer.json's pipeline and rebuilds Qwen2's (NFC included) from its vocab and merges.
With NFC in tokenizer.json too, every loader (AutoTokenizer, the `tokenizers` library, vLLM) turns
the same text into the same ids; without it, they would disagree on non-NFC text.

Ids: the trained BPE vocabulary first, then the ChatML control tokens (special) and the four tool
tokens (added, not special, so they survive ``skip_special_tokens``), the layout of Qwen2.5.
Training is deterministic (same corpus and vocab size give the same tokenizer.json byte for byte);
`build_tokenizer` checks that the trained vocabulary reached its size.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engines.model.chat import CHAT_TEMPLATE, CONTROL_TOKENS, ENDOFTEXT, IM_END, TOOL_CALL_FORMAT, TOOL_TOKENS
from engines.model.corpus import CORPUS_SEED, generate_corpus

# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2.5): contractions, words with one leading
# non-letter, single digits, punctuation runs, newlines, and spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (*CONTROL_TOKENS, *TOOL_TOKENS)
MODEL_MAX_LENGTH = 32768


def build_tokenizer(vocab_size: int, corpus_seed: int = CORPUS_SEED) -> PreTrainedTokenizerFast:
    """A transformers tokenizer with ``vocab_size`` ids in all (special tokens included) and the chat template."""
    from transformers import (
        PreTrainedTokenizerFast,
    )  # slow to import; train_tokenizer_json needs only tokenizers

    backend = Tokenizer.from_str(trained_tokenizer_json(vocab_size, corpus_seed))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=IM_END,  # the end of an assistant turn; the model's generation config adds ENDOFTEXT
        pad_token=ENDOFTEXT,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # it would rewrite " ." to "." and break round trips
        padding_side="left",
        split_special_tokens=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> list[str]:
    """Writes tokenizer.json + tokenizer_config.json (chat template inline); returns the file names."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["gyre_tool_call_format"] = TOOL_CALL_FORMAT
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))


@functools.lru_cache(maxsize=4)
def trained_tokenizer_json(vocab_size: int, corpus_seed: int = CORPUS_SEED) -> str:
    """The serialized `tokenizers` tokenizer: a pure function of its arguments, so it is trained once
    per process (``trained_tokenizer_json.__wrapped__`` trains afresh)."""
    bpe_size = vocab_size - len(SPECIAL_TOKENS)
    if bpe_size < 512:
        raise ValueError(f"vocab_size {vocab_size} is too small: the byte alphabet alone takes 256 ids")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()  # what AutoTokenizer applies to qwen2 models anyway
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(generate_corpus(corpus_seed), trainer=trainer)
    trained = tokenizer.get_vocab_size()
    if trained != bpe_size:
        raise ValueError(
            f"the corpus gave only {trained} BPE tokens, {bpe_size} were asked for: "
            "lower vocab_size or enlarge the corpus (engines/model/corpus.py)"
        )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer.to_str()
