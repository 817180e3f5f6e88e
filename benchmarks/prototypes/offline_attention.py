"""Kept: the decode attention kernel's registers and loop instructions counted without a GPU.

Registers, shared memory and the code before the first tensor-core product of the decode attention kernel
(``decoder._rope_attn_kernel``) compiled for sm_90 on a machine without a GPU: over the BF16 cache, QuaRot's 4-bit
cache (asymmetric, clip 0.95, the Q/K Hadamard) and the same 4-bit grid without the Hadamard.

The Llama-3-8B attention shape at batch 32 with a 520-slot cache cut in one chunk a head (the H200's cut from ~132
sequence × KV-head pairs): each program rotates its queries and, owning its head's new token, writes the new key
and value before its loop. The launcher runs on CPU tensors; the launch is replaced by a compile-only ``warmup``
for ``GPUTarget("cuda", 90, 32)`` (``offline_regs.py``'s stand-in driver), ``cuobjdump`` reads the cubin's
registers, and the PTX is read up to its first ``mma.sync``: the CTA barriers (``bar.sync``), warp shuffles and
shared-memory loads and stores there are those of the prologue (RoPE, the rotation, the new key's and value's
quantizer) and of the loop's first loads. The loop itself is read from the SASS (``cuobjdump -sass``): the
instructions between the kernel's longest backward branch and its target, one step of the loop as the GPU
issues it, with its CTA barriers (``BAR``), shared-memory loads and stores (``LDS``/``LDSM``, ``STS``), global
loads it waits for (``LDG``; the pipelined copies are ``LDGSTS``), spill reloads (``LDL``) and tensor-core products
(``HMMA``). ``--set NAME=VALUE`` (repeatable) puts a kernel setting in force first (a lower-case
``KernelSettings`` field: ``pdl=false``; an entry of the tile table: ``attn_kv4_block_n=64``,
``attn_new_cached=false``), or sets a tuned ``decoder`` constant (upper case: ``ATTN_BLOCK_N=32``; the text for a
constant that is a string, else a number of its type).
Leaves the process's Triton driver replaced: run it on its own.

    python3 benchmarks/prototypes/offline_attention.py [--set attn_kv4_block_n=64 --set attn_new_cached=false]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / part) for part in ("kernels", "prototypes")]

from offline_regs import _CompileOnlyDriver, compile_only  # noqa: E402

from mosaicquant import settings  # noqa: E402
from mosaicquant.kernels.tile_table import TileTable  # noqa: E402

#: the tile table's entries
TILE_ENTRIES = {f.name for f in dataclasses.fields(TileTable)}

HEADS, KV_HEADS, D, BATCH, SLOTS, CHUNK = 32, 8, 128, 32, 520, 640
REGS_PER_SM, SMEM_PER_SM = 65536, 227 * 1024
COUNTED = ("bar.sync", "shfl.sync", "ld.shared", "st.shared", "div.rn")
LOOP_COUNTED = ("BAR", "LDS", "STS", "LDG", "LDL", "HMMA")
_SASS = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def loop_counts(sass: str) -> tuple[int, collections.Counter]:
    """Instructions in the SASS's widest backward branch (the attention loop: its target to the branch) and their
    opcodes' counts (``LDS`` counts ``LDSM`` too)."""
    code = [(int(a, 16), t) for a, t in _SASS.findall(sass)]
    spans = [(int(m.group(1), 16), at) for at, t in code if (m := _BRANCH.search(t)) and int(m.group(1), 16) < at]
    if not spans:
        raise ValueError("no backward branch in the kernel's SASS: no loop to count")
    lo, hi = max(spans, key=lambda span: span[1] - span[0])
    body = [t for at, t in code if lo <= at <= hi]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    ops["LDS"] += ops.pop("LDSM", 0)
    return len(body), ops


def set_constant(module, attr: str, text: str) -> None:
    """``module.attr`` set from ``text`` for this compile only: the text for a string constant, else a number of the
    constant's type (a constant that is None takes an int where the number is whole)."""
    cur = getattr(module, attr)
    if isinstance(cur, str):
        setattr(module, attr, text)
        return
    try:
        val = float(text)
    except ValueError:
        raise SystemExit(f"{attr} takes a number, got {text!r}") from None
    setattr(module, attr, (int(val) if val.is_integer() else val) if cur is None else type(cur)(val))


def _set(dec, item: str, chosen: dict) -> None:
    """``NAME=VALUE``: a kernel setting into ``chosen`` (lower case), else set on ``dec``
    (:func:`set_constant`'s typing)."""
    name, eq, text = item.partition("=")
    if eq and name in TILE_ENTRIES:
        chosen.setdefault("tiles", {})[name] = text
        return
    if eq and name.islower():
        chosen[name] = text
        return
    if not eq or not hasattr(dec, name):
        raise SystemExit(f"--set {item!r}: expected NAME=VALUE with NAME a KernelSettings field or a constant of "
                         "mosaicquant.kernels.decoder")
    set_constant(dec, name, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a decoder constant set before compiling (repeatable)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("offline_attention.py compiles for the GPU: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    dec = importlib.import_module("mosaicquant.kernels.decoder")
    chosen = {}
    for item in args.set:
        _set(dec, item, chosen)
    with settings.use(**chosen):
        return _report(dec, args)


def _report(dec, args) -> int:
    driver.set_active(_CompileOnlyDriver())
    dec.check_triton_device = lambda device: None
    dec.resolve_kernel = lambda kernel, device: "triton"
    compiled = compile_only(dec, "_rope_attn_kernel")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    qkv = torch.zeros(BATCH, (HEADS + 2 * KV_HEADS) * D, dtype=torch.bfloat16)
    pos = torch.full((BATCH,), SLOTS - 8)
    cos = torch.zeros(SLOTS, D, dtype=torch.bfloat16)
    if args.set:
        print("decoder:", ", ".join(args.set))
    print("| cache | registers a thread | shared bytes | programs an SM | PTX lines before the first product / all | "
          + " | ".join(f"`{c}` before / all" for c in COUNTED) + " | loop: SASS instructions a step | "
          + " | ".join(f"loop `{c}`" for c in LOOP_COUNTED) + " |")
    print("|---" * (6 + len(COUNTED) + len(LOOP_COUNTED)) + "|")
    for name, kv in (("BF16", None), ("4-bit, Q/K Hadamard (QuaRot)", dec.KVFormat(4, False, 0.95, True)),
                     ("4-bit, no Hadamard", dec.KVFormat(4, False, 0.95, False))):
        if kv is None:
            kc = torch.zeros(BATCH, KV_HEADS, SLOTS, D, dtype=torch.bfloat16)
            scales = None
        else:
            kc = torch.zeros(BATCH, KV_HEADS, SLOTS, D // 2, dtype=torch.uint8)
            scales = dec.KVScales.empty(BATCH, KV_HEADS, SLOTS, "cpu")
        dec.decode_rope_attention(qkv, pos, cos, cos.clone(), kc, kc.clone(), HEADS, KV_HEADS, D ** -0.5, chunk=CHUNK,
                                  kernel="triton", kv=kv, scales=scales)
        ck = compiled[-1].result() if hasattr(compiled[-1], "result") else compiled[-1]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(ck.asm["cubin"])
            fh.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                                   check=True).stdout
            n_loop, ops = loop_counts(subprocess.run([cuobjdump, "-sass", fh.name], capture_output=True, text=True,
                                                     check=True).stdout)
        regs = int(next(t.split(":")[1] for t in usage.split() if t.startswith("REG:")))
        spills = [t for t in usage.split() if t.startswith(("STACK:", "LOCAL:")) and not t.endswith(":0")]
        warps = ck.metadata.num_warps
        shared = ck.metadata.shared
        per_sm = min(REGS_PER_SM // (-(-regs * 32 // 256) * 256 * warps), SMEM_PER_SM // max(shared, 1))
        ptx = ck.asm["ptx"].splitlines()
        first = next(i for i, line in enumerate(ptx) if "mma.sync" in line)
        counts = " | ".join(f"{sum(c in line for line in ptx[:first])} / {sum(c in line for line in ptx)}"
                            for c in COUNTED)
        print(f"| {name} | {regs}{' (spills: ' + ', '.join(spills) + ')' if spills else ''} | {shared} | {per_sm} | "
              f"{first} / {len(ptx)} | {counts} | {n_loop} | " + " | ".join(str(ops[c]) for c in LOOP_COUNTED) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
