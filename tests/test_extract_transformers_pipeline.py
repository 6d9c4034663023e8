"""The transformers extractor's pipeline: packed samples, unmasked right padding, views, early stop, hooks."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from draftflow.extract.hidden_states import Fp8States, to_storage
from draftflow.extract.layout import Sample
from draftflow.extract.transformers_backend import (
    TransformersExtractor,
    batches_by_token_budget,
)

LAYERS = 4


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def samples(lengths):
    generator = torch.Generator().manual_seed(1)
    return [Sample(i, f"s{i}", torch.randint(0, 200, (n,), generator=generator).tolist()) for i, n in enumerate(lengths)]


def assert_states_of_each_sample_alone(model, got: dict, batch, layer_ids: list[int]) -> None:
    """Each sample's states are Hugging Face's for the sample run alone (the last slot is
    before the final norm: normed, it is Hugging Face's last state)."""
    for sample in batch:
        with torch.no_grad():
            reference = model(torch.tensor([sample.token_ids]), output_hidden_states=True).hidden_states
            states = got[sample.sample_id]
            assert states.shape == (len(sample.token_ids), len(layer_ids), 32)
            for slot, layer_id in enumerate(layer_ids[:-1]):
                torch.testing.assert_close(states[:, slot], reference[layer_id][0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(model.model.norm(states[:, -1]), reference[-1][0], atol=1e-5, rtol=1e-4)


def test_packed_samples_attend_only_to_themselves(tiny_model):
    """One row of the samples end to end, no padding at all; each sample's states are those
    of the sample alone."""
    batch = samples([40, 23, 7, 31])
    extractor = TransformersExtractor(tiny_model, [1, 3, LAYERS], token_budget=101, device="cpu")
    assert extractor.packed
    got = {s.sample_id: states for s, states in extractor(batch)}
    assert extractor.timings["batches"] == 1 and extractor.timings["padded_tokens"] == extractor.timings["tokens"] == 101
    assert_states_of_each_sample_alone(tiny_model, got, batch, [1, 3, LAYERS])
    extractor.close()
    assert tiny_model.config._attn_implementation == "sdpa"


def test_a_sliding_window_decoder_gets_right_padded_rows_without_a_mask():
    """Packed attention applies no window, so such a decoder runs padded rows causally without
    a mask: real positions never see the padding after them."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=16,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    batch = samples([40, 23, 7, 31])
    extractor = TransformersExtractor(model, [1, 3, LAYERS], token_budget=4 * 40, device="cpu")
    assert extractor.packing_refusal == "it attends within a sliding window"
    got = {s.sample_id: states for s, states in extractor(batch)}
    assert extractor.timings["batches"] == 1 and extractor.timings["padded_tokens"] == 4 * 40
    assert_states_of_each_sample_alone(model, got, batch, [1, 3, LAYERS])


def test_samples_are_contiguous_views_of_their_batch(tiny_model):
    """write_sample's .contiguous() is then free: no copy per sample."""
    extractor = TransformersExtractor(tiny_model, [2, LAYERS], token_budget=10_000, device="cpu")
    items = list(extractor(samples([12, 30, 5])))
    bases = {states.untyped_storage().data_ptr() for _, states in items}
    assert len(bases) == 1
    assert all(states.is_contiguous() for _, states in items)


def test_stopping_early_and_removing_the_hooks(tiny_model):
    many = samples([9] * 12)
    extractor = TransformersExtractor(tiny_model, [1, LAYERS], token_budget=27, device="cpu")
    stream = extractor(many)
    first = [next(stream) for _ in range(4)]
    stream.close()  # the consumer stopped (a kill, a failed write): nothing is left running
    assert [s.index for s, _ in first] == [s.index for s in list(batches_by_token_budget(many, 27))[0]] + [3]
    assert extractor.timings["batches"] == 2
    hooks = sum(len(layer._forward_hooks) for layer in tiny_model.model.layers)
    extractor.close()
    assert sum(len(layer._forward_hooks) for layer in tiny_model.model.layers) == hooks - 2
    assert not extractor.capture.captured


def test_fp8_storage_quantizes_each_token_over_its_layers_before_handing_it_over(tiny_model):
    """The batch is quantized where it was computed (on a GPU: before the copy to the host);
    each sample gets the values and scales the writer would have made of its own states."""
    batch = samples([40, 23, 7])
    full = dict((s.sample_id, states) for s, states in TransformersExtractor(tiny_model, [1, 3, LAYERS], 4 * 40, "cpu")(batch))
    fp8 = dict((s.sample_id, states) for s, states in
               TransformersExtractor(tiny_model, [1, 3, LAYERS], 4 * 40, "cpu", storage="fp8")(batch))  # fmt: skip
    for sample in batch:
        expected = to_storage(full[sample.sample_id], "fp8")
        assert isinstance(fp8[sample.sample_id], Fp8States) and fp8[sample.sample_id].scales.shape == (len(sample.token_ids), 1, 1)
        assert torch.equal(fp8[sample.sample_id].values.view(torch.uint8), expected.values.view(torch.uint8))
        assert torch.equal(fp8[sample.sample_id].scales, expected.scales)
