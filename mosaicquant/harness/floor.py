"""The physical floor of a speed cell: what the card's memory and tensor cores allow.

A decode step at batch ``B`` with ``C`` cached tokens must read, at least once, every weight
byte of the decoder layers (packed values, scales, zero points, the residual's values and
indices: what the quantized modules store), the output head, ``B`` embedding rows and the
KV cache of ``C + 1`` positions. Those bytes over the card's copy bandwidth are the decode
floor; a prefill's floor is its matrix flops over the tensor-core rate of the arithmetic its
linears use (INT8 for the packed 4-bit layers, BF16 for float ones). The ``throughput``
suite measures the ceilings on the card it runs on, in the same run, and records each
step's bytes and its fraction of the floor (``floor time / measured time``: 1.0 is the
physics, 0.5 is half as fast as the bytes allow).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["Ceilings", "measure_ceilings", "prefill_floor_rate", "module_bytes", "tensor_bytes", "decode_bytes", "prefill_flops", "quantized_linears",
           "floor_fraction", "byte_floor_us"]

#: bytes copied per bandwidth sample (well past any L2 cache)
COPY_BYTES = 1 << 30
#: side of the square matrix product timed for the tensor-core rates
MATMUL_SIDE = 8192

_measured: dict[tuple[str, int | None], Ceilings] = {}


@dataclass(frozen=True)
class Ceilings:
    """What one card sustains, measured on it.

    Attributes:
        copy_gb_s: device-to-device copy, bytes read plus bytes written per second / 1e9.
        bf16_tflop_s: dense BF16 matrix product (cuBLAS), 1e12 flop/s.
        int8_tflop_s: dense INT8 matrix product (``torch._int_mm``), 1e12 op/s; None where it cannot run.
        gpu: the card's name.
    """

    copy_gb_s: float
    bf16_tflop_s: float
    int8_tflop_s: float | None
    gpu: str

    def as_dict(self) -> dict:
        return asdict(self)


def _median_ms(fn, replays: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(device: torch.device, replays: int = 9) -> Ceilings:
    """Copy bandwidth and BF16 / INT8 tensor-core rates of ``device`` (measured once per process and card)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"ceilings are measured on a CUDA GPU, got device {device}")
    key = (device.type, device.index)
    if key in _measured:
        return _measured[key]
    with torch.cuda.device(device):
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = _median_ms(lambda: dst.copy_(src), replays)
        copy = 2 * COPY_BYTES / (ms * 1e-3) / 1e9
        del src, dst
        n = MATMUL_SIDE
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        ms = _median_ms(lambda: torch.mm(a, b), replays)
        bf16 = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
        int8 = None
        try:
            ai = torch.randint(-8, 8, (n, n), device=device, dtype=torch.int8)
            # the second operand column-major: cuBLASLt's INT8 tensor-core product takes its operands "TN"
            bi = torch.randint(-8, 8, (n, n), device=device, dtype=torch.int8).t()
            ms = _median_ms(lambda: torch._int_mm(ai, bi), replays)
            int8 = 2 * n**3 / (ms * 1e-3) / 1e12
        except RuntimeError:
            pass
        torch.cuda.empty_cache()
        _measured[key] = Ceilings(copy, bf16, int8, torch.cuda.get_device_name(device))
    return _measured[key]


def prefill_floor_rate(ceilings: Ceilings, quantized: bool) -> tuple[float | None, str]:
    """The tensor-core rate (1e12 op/s) a prefill's floor divides its flops by, and what it is.

    Packed quantized linears run INT8 products; a measured INT8 rate below the BF16 one is not the INT8
    tensor cores' rate (INT8 has at least BF16's rate on every tensor-core GPU), so that floor is
    ``None`` and the text says why, rather than a floor slower than the card.
    """
    if not quantized:
        return ceilings.bf16_tflop_s, "BF16 tensor cores"
    if ceilings.int8_tflop_s is None:
        return None, "unavailable: the INT8 product (torch._int_mm) did not run on this device"
    if ceilings.int8_tflop_s < ceilings.bf16_tflop_s:
        return None, (f"unavailable: the INT8 product measured {ceilings.int8_tflop_s:.0f} TFLOP/s, below BF16's "
                      f"{ceilings.bf16_tflop_s:.0f}, not the tensor cores' rate")
    return ceilings.int8_tflop_s, "INT8 tensor cores"


def module_bytes(module: torch.nn.Module, seen: set[int] | None = None) -> int:
    """Bytes a forward pass of ``module`` must read of its own state, each stored module counted once.

    A packed quantized module (one with ``weight_nbytes()``) counts what it stores (values, scales,
    zero points, residual) and nothing below it; the members of a fused projection group count the
    group's stacked layer once; any other module counts its parameters and buffers and its children.
    """
    seen = set() if seen is None else seen
    group = getattr(module, "group", None)
    if group is not None and hasattr(group, "quant"):
        return module_bytes(group.quant, seen)
    if id(module) in seen:
        return 0
    seen.add(id(module))
    if hasattr(module, "weight_nbytes"):
        return int(sum(module.weight_nbytes().values()))
    total = sum(tensor_bytes(t) for t in module.parameters(recurse=False))
    total += sum(tensor_bytes(t) for t in module.buffers(recurse=False))
    return total + sum(module_bytes(child, seen) for child in module.children())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` stores: a tensor subclass that flattens into inner tensors (torchao's packed
    weights: values, scales, zero points) counts those, a plain tensor its elements."""
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    flatten = getattr(data, "__tensor_flatten__", None)
    if flatten is not None and type(data) is not torch.Tensor:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(data, name)) for name in names if getattr(data, name) is not None)
    return int(data.numel() * data.element_size())


def quantized_linears(model: torch.nn.Module) -> bool:
    """Whether the model's decoder layers hold packed quantized linears (their prefill floor uses INT8)."""
    return any(hasattr(m, "weight_nbytes") or hasattr(getattr(m, "group", None), "quant") for m in model.modules())


def _kv_bytes_per_token(model, decoder) -> float:
    """KV-cache bytes per cached token and sequence, all layers (the fused cache's own format if given)."""
    if decoder is not None:
        cache = decoder.new_cache(1, 16)
        per = cache.nbytes / 16
        del cache
        return per
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    elem = model.get_input_embeddings().weight.element_size()
    return 2.0 * int(cfg.num_hidden_layers) * kv_heads * head_dim * elem


def decode_bytes(model: torch.nn.Module, batch: int, context: int, decoder=None) -> int:
    """Bytes one decode step of ``batch`` sequences with ``context`` cached tokens must read.

    The decoder layers' state (:func:`module_bytes`), the final norm and output head, ``batch``
    embedding rows, and the KV cache of ``context + 1`` positions per sequence.
    """
    inner = model.model
    layers = sum(module_bytes(layer) for layer in inner.layers)
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    norm = getattr(inner, "norm", None)
    head_bytes = module_bytes(head) if head is not None else 0
    rows = batch * emb.weight.shape[1] * emb.weight.element_size()
    norm_bytes = module_bytes(norm) if norm is not None else 0
    kv = _kv_bytes_per_token(model, decoder) * batch * (context + 1)
    return int(layers + head_bytes + rows + norm_bytes + kv)


def prefill_flops(model: torch.nn.Module, batch: int, length: int) -> float:
    """Matrix flops of a prefill of ``batch × length`` tokens: the linears (2 per weight per token),
    causal attention (2 × 2 × length² / 2 × hidden per layer and sequence) and the output head at
    the last position."""
    cfg = model.config
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    layers = int(cfg.num_hidden_layers)
    weights = sum(_linear_weights(layer) for layer in model.model.layers)
    tokens = batch * length
    attention = layers * batch * 2.0 * length * length * heads * head_dim  # QK^T and PV, causal half
    head = batch * 2.0 * hidden * int(cfg.vocab_size)
    return 2.0 * weights * tokens + attention + head


def _linear_weights(module: torch.nn.Module) -> int:
    """Weights of the linears in ``module`` (a module with in and out features counts as one, whatever it stores)."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features) * int(module.out_features)
    return sum(_linear_weights(child) for child in module.children())


def byte_floor_us(nbytes: float, copy_gb_s: float) -> float:
    """µs to read ``nbytes`` at the card's copy bandwidth ``copy_gb_s`` (GB/s): a decode step's byte floor.

    Raises:
        ValueError: a bandwidth that is not a positive finite number.
    """
    if not (math.isfinite(copy_gb_s) and copy_gb_s > 0):
        raise ValueError(f"copy bandwidth must be a positive finite GB/s, got {copy_gb_s}")
    return nbytes / (copy_gb_s * 1e9) * 1e6


def floor_fraction(floor_us: float, measured_us: float) -> float:
    """``floor / measured``: 1.0 runs at the floor, below 1 is that fraction of what the card allows."""
    if measured_us <= 0:
        raise ValueError(f"measured time must be positive, got {measured_us}")
    return floor_us / measured_us
