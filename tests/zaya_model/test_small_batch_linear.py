"""The few-row CPU linear of decoding: same values as `F.linear`, taken only where its results are reproducible."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from zaya_model.small_batch_linear import ALIGNMENT_BYTES, MAX_SMALL_BATCH_ROWS, align_parameters, linear


@pytest.fixture
def threads():
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, MAX_SMALL_BATCH_ROWS])
@torch.no_grad()
def test_matches_f_linear(threads, num_threads, rows):
    threads(num_threads)
    torch.manual_seed(rows)
    inputs, weight, bias = torch.randn(rows, 96), torch.randn(128, 96), torch.randn(128)
    for with_bias in (None, bias):
        torch.testing.assert_close(linear(inputs, weight, with_bias), F.linear(inputs, weight, with_bias))
    # Leading dimensions are kept: [batch, seq, in] -> [batch, seq, out].
    batched = inputs.view(1, rows, 96)
    assert linear(batched, weight).shape == (1, rows, 128)


def _misaligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype)
    return storage[1:].view_as(tensor).copy_(tensor)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops_of(*args) -> set[str]:
    with _RecordOps() as recorder:
        linear(*args)
    return recorder.ops


@torch.no_grad()
def test_split_path_runs_only_for_few_rows_aligned_weights_and_no_autograd(threads):
    threads(2)
    torch.manual_seed(0)
    inputs, weight = torch.randn(4, 512), torch.randn(1024, 512)
    assert weight.data_ptr() % ALIGNMENT_BYTES == 0
    assert "bmm" in _ops_of(inputs, weight)

    too_many = torch.randn(MAX_SMALL_BATCH_ROWS + 1, 512)
    misaligned = _misaligned_copy(weight)
    for args in ((too_many, weight), (inputs, misaligned)):
        assert "bmm" not in _ops_of(*args)
        assert torch.equal(linear(*args), F.linear(*args))
    with torch.enable_grad():  # training keeps F.linear (and its gradients)
        assert "bmm" not in _ops_of(inputs, weight)


@torch.no_grad()
def test_results_do_not_depend_on_where_the_weight_sits(threads):
    threads(2)
    torch.manual_seed(1)
    inputs, weight = torch.randn(2, 64), torch.randn(128, 64)
    reference = linear(inputs, weight)
    storage = torch.empty(weight.numel() + 64)
    for offset in range(0, 64, 4):  # every 16-byte offset; misaligned ones fall back to F.linear
        moved = storage[offset : offset + weight.numel()].view_as(weight).copy_(weight)
        expected = reference if moved.data_ptr() % ALIGNMENT_BYTES == 0 else F.linear(inputs, weight)
        assert torch.equal(linear(inputs, moved), expected)


def test_align_parameters_copies_every_tensor_when_one_is_misaligned_and_keeps_ties():
    embedding = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embedding.weight  # tied
    embedding.weight.data = _misaligned_copy(torch.arange(128.0).view(16, 8))
    aligned = torch.nn.Linear(8, 8)
    aligned.register_buffer("counts", torch.arange(4.0))
    head.register_buffer("counts", aligned.counts)  # one buffer in two modules
    before = {name: tensor.clone() for name, tensor in aligned.state_dict().items()}
    old_buffer = aligned.counts
    model = torch.nn.ModuleList([embedding, head, aligned])
    old_pointers = {tensor.data_ptr() for tensor in (*model.parameters(), *model.buffers())}
    align_parameters(model)
    tensors = (*model.parameters(), *model.buffers())
    # All copied, so none of them keeps the misaligned tensor's storage (in practice, a checkpoint mapping) alive.
    assert all(t.data_ptr() % ALIGNMENT_BYTES == 0 and t.data_ptr() not in old_pointers for t in tensors)
    assert aligned.counts is not old_buffer  # a new buffer object: other holders of the old one keep only it
    assert head.weight is embedding.weight and head.counts is aligned.counts
    assert torch.equal(embedding.weight, torch.arange(128.0).view(16, 8))
    for name, value in aligned.state_dict().items():
        assert torch.equal(value, before[name])


def test_align_parameters_leaves_an_aligned_model_alone():
    model = torch.nn.Linear(8, 8)
    pointers = [p.data_ptr() for p in model.parameters()]
    align_parameters(model)
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_from_pretrained_does_not_keep_the_checkpoint_mapped_beside_its_copies(tmp_path):
    from tiny_models import TINY_ZAYA

    from zaya_model import ZayaConfig, ZayaForCausalLM

    ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)).save_pretrained(tmp_path)
    model = ZayaForCausalLM.from_pretrained(tmp_path)
    tensors = (*model.parameters(), *model.buffers())
    assert all(t.data_ptr() % ALIGNMENT_BYTES == 0 for t in tensors)
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if str(tmp_path) in line]
    assert not mapped  # the file's pages would stay resident beside the aligned copies (1.8x the model's RSS)
