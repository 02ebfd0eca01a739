"""The character-level tokenizer of the built-in task sets, in Hugging Face format.

Every character of `CHARSET` is one token; `<bos>` is prepended to encoded text, `<eos>` ends
a response and `<pad>` fills batches. Decoding concatenates tokens without separators.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import cast

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
_BASE_CHARSET = string.digits + "+-*/=?" + " " + string.ascii_letters + ".,:;!'()"
# Every printable ASCII character: the rest of the punctuation comes after the first set,
# so those ids are unchanged; `\`, `{`, `}` and `$` let math answers such as \boxed{...} through.
CHARSET = _BASE_CHARSET + "".join(c for c in string.punctuation if c not in _BASE_CHARSET)
# `tokenizer_class` values of a plain `tokenizers` tokenizer (the built-in one among them),
# loaded without `AutoTokenizer`, whose import loads torch (0.6 s instead of 1.8 s)
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def unknown_chars(text: str) -> list[str]:
    """The characters of `text` the built-in tokenizer cannot encode, in order of appearance."""
    seen: list[str] = []
    for char in text:
        if char not in CHARSET and char not in seen:
            seen.append(char)
    return seen


def build_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The character-level tokenizer; saved with `save_pretrained` into `out_dir` if given."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARSET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in HF directory `path`; a clear error if there is none."""
    directory = Path(path)
    saved = directory / "tokenizer_config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"no tokenizer in {directory}: tokenizer_config.json is missing")
    if json.loads(saved.read_text()).get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _ids(tokenizer: PreTrainedTokenizerBase, text: str, where: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        bad = unknown_chars(text) or ["?"]
        raise ValueError(f"{where}: {text!r} has characters the tokenizer does not know: {bad}")
    return ids


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, where: str) -> list[int]:
    """Prompt token ids: `<bos>` and the prompt's tokens; unknown characters raise."""
    ids = _ids(tokenizer, prompt, where)
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else ids


def encode_response(tokenizer: PreTrainedTokenizerBase, text: str, where: str) -> list[int]:
    """Response token ids: the text's tokens and `<eos>`; unknown characters raise."""
    return [*_ids(tokenizer, text, where), tokenizer.eos_token_id]


def decode_response(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """The text of one token sequence, special tokens kept (what reward functions score)."""
    # One sequence decodes to one str; transformers types `decode` for batches too.
    return cast(str, tokenizer.decode(token_ids, skip_special_tokens=False))
