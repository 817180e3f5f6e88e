"""Where the simulated and the kernel-backed model part: every quantized linear, on CPU or GPU.

For each method, the simulated (fake-quant) model and its ``kernelize`` form run on the same tokens;
per linear it prints, as max |difference| over the reference's max |value|:

- ``same_input``: the kernel layer on the simulated layer's own input, against the simulated output
  rounded to BF16 (a wiring error shows here, in its layer);
- ``input`` / ``output``: the two models' inputs and outputs of that layer, each running freely
  (the drift, which 4-bit quantizers amplify from one-ulp differences).

And for the logits: kernel against simulated, the simulation with BF16-rounded outputs against the
plain one (the rounding's own drift), and simulated against the float model (the quantization error).

    python benchmarks/kernels/sim_vs_kernel.py --model smollm2-135m --layers 2 --methods rtn,quarot,mosaicquant
"""

from __future__ import annotations

import argparse
import copy

import torch

from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.spec import parse_plugin_list
from mosaicquant.kernels.convert import kernelize
from mosaicquant.methods.qlinear import FakeQuantLinear

TEXT = ("Alabama is a state in the southeastern region of the United States. It borders Tennessee to the north "
        "and Georgia to the east. Quantization maps real numbers onto a small grid of integers. ") * 3


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _record(model, names):
    seen, hooks = {}, []
    for name in names:
        def keep(mod, args, out, name=name):
            seen[name] = (args[0].detach().clone(), out.detach().clone())
        hooks.append(model.get_submodule(name).register_forward_hook(keep))
    return seen, hooks


def _model_and_tokens(name: str, layers: int):
    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        gen = torch.Generator().manual_seed(0)
        return LlamaForCausalLM(cfg).eval(), torch.randint(0, 97, (4, 32), generator=gen), \
            torch.randint(0, 97, (2, 19), generator=gen)
    from mosaicquant.harness.models import load_model

    lm = load_model(name)
    model = lm.model.eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    return model, ids[:, :64].repeat(2, 1), ids[:, 64:96]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random Llama, hidden 64) or a model name")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept")
    parser.add_argument("--methods", default="rtn,quarot,mosaicquant:block=16x64:budget=0.3:base=rtn")
    parser.add_argument("--kernel", default="torch", choices=("torch", "triton", "auto"))
    args = parser.parse_args()
    base, calib, ids = _model_and_tokens(args.model, args.layers)
    for spec in parse_plugin_list(args.methods, "method"):
        item, config, fn = spec.label, spec.config, spec.entry.fn
        ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)
        sim = fn(copy.deepcopy(base), config, ctx)
        names = [n for n, m in sim.named_modules() if isinstance(m, FakeQuantLinear)]
        fast = copy.deepcopy(sim)
        report = kernelize(fast, kernel=args.kernel)
        rounded = copy.deepcopy(sim)
        for module in rounded.modules():
            if isinstance(module, FakeQuantLinear):
                module.output_rounding = torch.bfloat16
        seen_sim, hooks_sim = _record(sim, names)
        seen_fast, hooks_fast = _record(fast, names)
        with torch.no_grad():
            ref, out, ref_rounded, flt = (m(input_ids=ids).logits.float() for m in (sim, fast, rounded, base))
            for hook in hooks_sim + hooks_fast:
                hook.remove()
            print(f"== {item} on {args.model} ({args.layers} layers, kernel={args.kernel}, "
                  f"{len(report.converted)} converted, {len(report.skipped)} skipped): logits kernel vs simulated "
                  f"{_rel(out, ref):.4f}, BF16-rounded simulation vs simulated {_rel(ref_rounded, ref):.4f}, "
                  f"kernel vs BF16-rounded simulation {_rel(out, ref_rounded):.2e}, simulated vs float {_rel(ref, flt):.3f}")
            print(f"{'layer':40s} {'same_input':>10s} {'input':>8s} {'output':>8s}")
            for name in names:
                (x, y), (xk, yk) = seen_sim[name], seen_fast[name]
                same = _rel(fast.get_submodule(name)(x), y.to(torch.bfloat16))
                print(f"{name:40s} {same:10.3g} {_rel(xk, x):8.3g} {_rel(yk, y):8.3g}")


if __name__ == "__main__":
    main()
