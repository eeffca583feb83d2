"""The in-process client (GenerationService over an EngineLoop, no HTTP): samples equal the engine's own,
admission refuses past capacity and frees on close, and incremental decoding of a byte-level tokenizer
reassembles multi-byte characters exactly."""

from __future__ import annotations

import asyncio

import pytest

from rollout.request import SamplingParams
from rollout.server.engine_loop import EngineLoop
from rollout.server.generation import GenerationRequest, GenerationService, Overloaded, RequestError
from rollout.server.tokenization import Decoder
from tests.server.common import config, twin


@pytest.fixture(scope="module")
def pair():
    """(service over a running engine loop, an independent twin engine)."""
    served = twin(config())
    loop = EngineLoop(served.engine)
    loop.start()
    yield GenerationService(loop, served.tokenizer, capacity=4), twin(config())
    loop.stop(timeout=10)


def test_samples_equal_the_engine_and_capacity_is_given_back(pair):
    service, ref = pair
    tok = service.tokenizer
    prompts = [tok.encode(t) for t in ("12+3=", "7-9=")]
    params = SamplingParams(temperature=0, max_new_tokens=6)

    async def main():
        with pytest.raises(RequestError, match="at most 4 in flight"):  # never fits: a 400, not a 429
            service.open([GenerationRequest(prompts[0], params, n=3), GenerationRequest(prompts[1], params, n=2)])
        async with service.open([GenerationRequest(p, params, n=2) for p in prompts]) as gen:
            assert service.in_flight == 4
            with pytest.raises(Overloaded):
                service.open([GenerationRequest(prompts[0], params)])
            samples = await gen.result()
        assert service.in_flight == 0
        return samples

    samples = asyncio.run(main())
    want = ref.engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    )
    assert [s.index for s in samples] == [0, 1, 2, 3]
    for s, w in zip(samples, [want[0], want[0], want[1], want[1]]):
        assert s.token_ids == w.output_ids and s.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert s.text == tok.decode(w.output_ids) and s.finish_reason == w.finish_reason.value


def byte_level_tokenizer():
    """A byte-level BPE trained here on a few lines: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["hello world", "héllo wörld", "naïve café"] * 20,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return tok


def test_incremental_decoding_reassembles_split_characters():
    tok = byte_level_tokenizer()
    text = "héllo wörld ✓ 你好 café"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # the rare characters arrive as several byte tokens
    dec = Decoder(lambda xs: tok.decode(xs))
    pieces = [dec.push([t]) for t in ids]
    assert "".join(pieces) + dec.finish() == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
