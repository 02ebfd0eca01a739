"""The character-level tokenizer: HF round trip, special tokens, unknown characters."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from trinity_dagster.tokenizer import (
    BOS,
    CHARSET,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    build_tokenizer,
    encode_prompt,
    encode_response,
    load_tokenizer,
    unknown_chars,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def test_autotokenizer_round_trips_every_character(saved: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(saved))
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARSET)
    ids = tok(CHARSET, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARSET)  # one token per character, space included
    assert len(set(ids)) == len(CHARSET)
    assert tok.decode(ids) == CHARSET
    assert tok.convert_ids_to_tokens(ids) == list(CHARSET)


def test_special_tokens_and_bos_prefix(saved: Path) -> None:
    tok = load_tokenizer(saved)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok.padding_side == "left"
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert encode_prompt(tok, "12+7=", "here") == ids
    response = encode_response(tok, "19", "here")
    assert response[-1] == tok.eos_token_id and len(response) == 3
    assert tok.decode(ids + response, skip_special_tokens=False) == "<bos>12+7=19<eos>"
    assert tok.decode(ids + response, skip_special_tokens=True) == "12+7=19"


def test_unknown_characters_raise_naming_where_and_what(saved: Path) -> None:
    tok = load_tokenizer(saved)
    assert unknown_chars("a€b€ü") == ["€", "ü"]
    with pytest.raises(ValueError, match=r"task 't1'.*\['€'\]"):
        encode_prompt(tok, "1€2=", "task 't1'")
    with pytest.raises(ValueError, match="answer of t2"):
        encode_response(tok, "é", "answer of t2")


def test_load_tokenizer_missing_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path / "nope")
