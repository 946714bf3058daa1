"""A real Hugging Face fast tokenizer built offline: byte-level, no merges, ChatML chat template.

Why: tests and tiny-model runs need a tokenizer that goes through the same transformers code paths as a
real one (``__call__``, ``decode``, ``apply_chat_template``, special tokens) without any download.
Every UTF-8 byte is one token, so token counts are predictable (``len(text.encode())``).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer(chat_template: bool = True, bos: bool = False) -> Any:
    """Vocab: the 3 special tokens (ids 0..2: pad, im_start, im_end = EOS) then the 256 byte symbols.
    With `bos`, ``<|im_start|>`` doubles as BOS and plain (non-chat) encoding prepends it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    # unk = pad: byte-level BPE never needs it, and without one a Qwen2-class loader adds <|endoftext|> as
    # an extra id the tiny models have no row for (teacher/fidelity.py reports exactly that)
    kwargs = dict(pad_token="<|pad|>", unk_token="<|pad|>", eos_token="<|im_end|>",
                  additional_special_tokens=["<|im_start|>"])
    if bos:
        kwargs["bos_token"] = "<|im_start|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    return fast


def bpe_tokenizer(corpus: list[str], vocab_size: int, template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level BPE with merges learned from `corpus` (`vocab_size` ids in all), the same special tokens and
    EOS as `byte_tokenizer`: a second, different tokenization of the same text, for cross-tokenizer tests."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", unk_token="<|pad|>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    return fast


__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "bpe_tokenizer", "byte_tokenizer"]
