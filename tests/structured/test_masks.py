"""The host side of structured output on the built-in tokenizer: a first-token mask allows
exactly the tokens whose text starts a permitted output (checked against the tokenizer's own
decoding), masks of several rows at once equal those filled one by one, and flags mark the
constrained rows."""

import pytest
import torch

from moeferry.kernels.sampling.reference import allowed_tokens
from moeferry.structured import Constraint, GrammarCompiler, TokenMasks, json_schema_constraint


@pytest.fixture(scope="module")
def tokenizer(model_cache):
    from moeferry.default_model import ensure_default_model
    from moeferry.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(ensure_default_model())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_a_choice_allows_exactly_the_tokens_that_start_a_choice(tokenizer, compiler):
    choices = ("Pride", "Persuasion", "Emma")
    masks = TokenMasks(1, compiler.mask_words, pinned=False)
    assert masks.fill([compiler.matcher(Constraint("choice", choices))])
    allowed = allowed_tokens(masks.words[0], len(tokenizer))
    special = set(tokenizer.all_special_ids)
    expected = torch.zeros(len(tokenizer), dtype=torch.bool)
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        expected[token] = token not in special and bool(text) and any(c.startswith(text) for c in choices)
    assert torch.equal(allowed, expected), torch.nonzero(allowed ^ expected)[:, 0].tolist()


def test_masks_of_several_rows_equal_those_filled_one_by_one(compiler):
    matchers = [compiler.matcher(json_schema_constraint({"type": "object", "properties": {"a": {"type": "integer"}}})),
                None, compiler.matcher(Constraint("regex", "[0-9]{2,4}")), compiler.matcher(Constraint("json_object", ""))]
    together, alone = TokenMasks(5, compiler.mask_words, False), TokenMasks(5, compiler.mask_words, False)
    assert together.fill(matchers)
    assert together.flags.tolist()[:4] == [1, 0, 1, 1]
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill(alone.words, row)
            assert torch.equal(alone.words[row], together.words[row])
    assert not together.fill([None, None]) and together.flags.tolist()[:2] == [0, 0]


def test_a_finished_grammar_allows_only_the_end_token_then_stops(tokenizer, compiler):
    matcher = compiler.matcher(Constraint("choice", ("Emma",)))
    for token in tokenizer.encode("Emma"):
        assert matcher.accept(token)
    masks = TokenMasks(1, compiler.mask_words, False)
    masks.fill([matcher])
    assert torch.nonzero(allowed_tokens(masks.words[0], len(tokenizer)))[:, 0].tolist() == [tokenizer.eos_token_id]
    assert not matcher.finished and matcher.accept(tokenizer.eos_token_id) and matcher.finished
