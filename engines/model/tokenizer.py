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

from engines.model.corpus import CORPUS_SEED, generate_corpus
from engines.model.families import FAMILIES, Family

# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2.5): contractions, words with one leading
# non-letter, single digits, punctuation runs, newlines, and spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

QWEN = FAMILIES["qwen2"]
SPECIAL_TOKENS = (*QWEN.special, *QWEN.added)
MODEL_MAX_LENGTH = 32768


def build_tokenizer(
    vocab_size: int, corpus_seed: int = CORPUS_SEED, family: str = "qwen2"
) -> PreTrainedTokenizerFast:
    """A transformers tokenizer with ``vocab_size`` ids in all (special tokens included) and the chat
    template of ``family`` (families.py): the same trained BPE, that family's control tokens after it."""
    from transformers import (
        PreTrainedTokenizerFast,
    )  # slow to import; train_tokenizer_json needs only tokenizers

    chosen = FAMILIES[family]
    backend = Tokenizer.from_str(trained_tokenizer_json(vocab_size, corpus_seed, family))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=chosen.bos,
        eos_token=chosen.eos,  # the end of an assistant turn; the generation config adds the document's end
        pad_token=chosen.pad,
        unk_token=None,
        chat_template=chosen.chat_template,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # it would rewrite " ." to "." and break round trips
        padding_side="left",
        split_special_tokens=False,
    )


def save_tokenizer(
    tokenizer: PreTrainedTokenizerFast, folder: str | Path, family: str = "qwen2"
) -> list[str]:
    """Writes tokenizer.json + tokenizer_config.json (chat template inline, and the family's tool-call
    format as ``gyre_tool_call_format``); returns the file names."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["gyre_tool_call_format"] = FAMILIES[family].tool_call_format
    if family != "qwen2":
        # transformers picks a tokenizer class from config.json's model_type otherwise (LlamaTokenizer,
        # ...), some of which rebuild their own pipeline from the vocabulary: keep tokenizer.json's
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))


@functools.lru_cache(maxsize=8)
def trained_tokenizer_json(vocab_size: int, corpus_seed: int = CORPUS_SEED, family: str = "qwen2") -> str:
    """The serialized `tokenizers` tokenizer: the trained BPE, then ``family``'s control tokens
    (special) and its plain added tokens. A pure function of its arguments."""
    chosen: Family = FAMILIES[family]
    bpe_size = vocab_size - len(chosen.special) - len(chosen.added)
    tokenizer = Tokenizer.from_str(bpe_tokenizer_json(bpe_size, corpus_seed))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chosen.special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in chosen.added])
    return tokenizer.to_str()


@functools.lru_cache(maxsize=4)
def bpe_tokenizer_json(bpe_size: int, corpus_seed: int = CORPUS_SEED) -> str:
    """The trained byte-level BPE alone, ``bpe_size`` ids: trained once per process and arguments
    (``bpe_tokenizer_json.__wrapped__`` trains afresh)."""
    if bpe_size < 512:
        raise ValueError(f"{bpe_size} BPE ids are too few: the byte alphabet alone takes 256 ids")
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
    return tokenizer.to_str()
