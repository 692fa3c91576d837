"""Every Triton kernel compiles for a real GPU (sm_90 cubin through Triton's own ptxas), no GPU needed.

The interpreter (TRITON_INTERPRET=1, what the other tests run) accepts code the compiler rejects, e.g. a
kernel reading a plain Python global; this compiles each kernel in the specialisations its wrappers launch,
in a subprocess without the interpreter (under it ``@triton.jit`` makes functions that cannot compile).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's packages
from hkv import triton_kernels as hkv_kernels  # noqa: E402
from recompile.runtime.triton_kernels import (embedding, embedding_optimizer, interaction, jagged_attention,  # noqa: E402
                                    jagged_bmm, jagged_dense, jagged_softmax, offsets, softmax_attention)

I32 = "i32"


def _ptrs(kind, *names):
    return dict.fromkeys(names, f"*{kind}")


# (kernel, argument types, constexpr values): the specialisations the wrappers launch
SPECS = {
    f"embedding_{w}_{i}_{'backward' if b else 'forward'}": (
        embedding._grouped_kernel,
        {"meta_ptr": "*i64", **_ptrs("fp32" if b else w, "w_ptr"), **_ptrs(w, "out_ptr"), **_ptrs(i, "ids_ptr", "offs_ptr"),
         "psw_ptr": "*fp32", "err_ptr": "*i32", **dict.fromkeys(("num_items", "num_tables", "out_stride"), I32)},
        dict(BACKWARD=b, HAS_PSW=not b, BLOCK_T=4, BLOCK_B=16, BLOCK_L=embedding.BLOCK_L, BLOCK_D=64))
    for w, i, b in (("fp32", "i64", False), ("fp16", "i32", False), ("bf16", "i64", False), ("fp32", "i64", True),
                    ("bf16", "i32", True))
} | {
    f"optimizer_{kind}_{w}": (
        embedding_optimizer._step_kernel,
        {"meta_ptr": "*i64", "step_size_ptr": "*fp32", **_ptrs("i64", "keys_ptr", "order_ptr", "run_end_ptr"),
         **_ptrs("i32", "table_ptr", "bag_ptr"), **_ptrs("fp32", "factor_ptr", "s1_ptr", "s2_ptr"),
         **_ptrs(w, "grad_ptr", "w_ptr"), "n": I32, "grad_stride": I32,
         **dict.fromkeys(("lr", "eps", "beta1", "beta2"), "fp32")},
        dict(OPT=embedding_optimizer.OPTIMIZERS.index(kind), BLOCK_R=64, BLOCK_D=64))
    for kind in embedding_optimizer.OPTIMIZERS for w in ("fp32", "bf16")
} | {
    f"dot_interaction_{t}": (interaction._dot_interaction_kernel,
                             {**_ptrs(t, "t_ptr", "prefix_ptr", "out_ptr"),
                              **dict.fromkeys(("batch", "n", "d", "k", "out_cols"), I32)},
                             dict(UPPER=True, SELF=False, HAS_PREFIX=True, UPCAST=t == "fp32", BLOCK_F=32, BLOCK_D=64,
                                  BLOCK_K=128))
    for t in ("fp32", "bf16")
} | {
    "cross_linear": (interaction._linear_epilogue_kernel,
                     {**_ptrs("fp32", "a_ptr", "w_ptr", "bias_ptr", "x0_ptr", "x_ptr", "out_ptr", "hb_ptr"),
                      "m": I32, "n": I32, "kdim": I32},
                     dict(HAS_BIAS=True, CROSS=True, STORE_HB=True, RELU=False, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)),
    "mixture_combine": (interaction._mixture_combine_kernel,
                        {**_ptrs("fp32", "logits_ptr", "h_ptr", "x0_ptr", "x_ptr", "out_ptr"),
                         "batch": I32, "d": I32, "experts": I32},
                        dict(BLOCK_E=4, BLOCK_D=256)),
    "fm": (interaction._fm_kernel, {**_ptrs("fp32", "v_ptr", "out_ptr"), "batch": I32, "n": I32, "d": I32},
           dict(REDUCE=True, BLOCK_D=16)),
    "complete_cumsum": (offsets._complete_cumsum_kernel, {**_ptrs("i64", "lengths_ptr", "out_ptr"), "n": I32},
                        dict(BLOCK=offsets.BLOCK)),
    "hkv_probe_claim": (hkv_kernels._probe_kernel,
                        {**_ptrs("i64", "table_keys_ptr", "table_scores_ptr", "keys_ptr", "scores_ptr", "slots_ptr"),
                         "n": I32, "num_buckets": I32},
                        dict(BUCKET=128, BLOCK=hkv_kernels.BLOCK, CLAIM=True)),
} | {
    f"hkv_find_{row}_{w}": (hkv_kernels._find_kernel,
                            {**_ptrs("i64", "table_keys_ptr", "keys_ptr", "slots_ptr"), "values_ptr": f"*{w}",
                             "out_ptr": "*fp32" if row else f"*{w}", "found_ptr": "*i8",
                             **dict.fromkeys(("n", "num_buckets", "dim", "width"), I32)},
                            dict(BUCKET=128, ROW=row, BLOCK=hkv_kernels.FIND_BLOCK, BLOCK_D=64))
    for row, w in ((0, "fp32"), (0, "bf16"), (1, "u8"), (2, "u8"))
} | {
    f"hstu_{name}_{t}": (
        kernel, {**_ptrs(t, "q_ptr", "k_ptr", "v_ptr", "g_ptr", "out_ptr", "dk_ptr", "dv_ptr", "rel_ptr", "time_ptr"),
                 **_ptrs("fp32", "drel_ptr", "dtime_ptr"), **_ptrs("i32", "offsets_ptr", "tile_seq_ptr", "tile_start_ptr"),
                 **_ptrs("i64", "targets_ptr", "edges_ptr"), "ts_ptr": "*i64" if time == 1 else "*fp64",
                 **dict.fromkeys(("num_items", "heads", "head_dim", "value_dim", "max_seq_len", "contextual",
                                  "num_buckets", "steps"), I32),
                 "alpha": "fp32", "inv_norm": "fp32"},
        dict(CAUSAL=True, HAS_REL=True, HAS_TARGETS=True, MASKED=True, TIME=time, BLOCK=jagged_attention.BLOCK,
             BLOCK_D=64, BLOCK_V=64, **flags))
    for t, time in (("fp32", 1), ("bf16", 2))
    for name, kernel, flags in (("forward", jagged_attention._query_tiles_kernel, dict(DQ=False)),
                                ("dq", jagged_attention._query_tiles_kernel, dict(DQ=True)),
                                ("dkdv", jagged_attention._hstu_dkdv_kernel, {}))
} | {
    f"softmax_{name}_{t}": (
        kernel, {**_ptrs(t, "q_ptr", "k_ptr", "v_ptr", "g_ptr", "out_ptr", "dk_ptr", "dv_ptr"),
                 **_ptrs("fp32", "lse_ptr", "delta_ptr"), **_ptrs("i32", "offsets_ptr", "tile_seq_ptr", "tile_start_ptr"),
                 **dict.fromkeys(("num_items", "heads", "head_dim", "value_dim"), I32), "scale": "fp32"},
        dict(CAUSAL=True, BLOCK=jagged_attention.BLOCK, BLOCK_D=64, BLOCK_V=64, **flags))
    for t in ("fp32", "bf16")
    for name, kernel, flags in (("forward", softmax_attention._query_kernel, dict(DQ=False)),
                                ("dq", softmax_attention._query_kernel, dict(DQ=True)),
                                ("dkdv", softmax_attention._key_kernel, {}))
} | {
    f"jagged_softmax_{'backward' if b else 'forward'}_{t}": (
        jagged_softmax._softmax_kernel,
        {**_ptrs(t, "x_ptr", "g_ptr", "out_ptr"), "offsets_ptr": "*i32",
         **dict.fromkeys(("num_items", "col_blocks", "dim", "max_len"), I32)},
        dict(BACKWARD=b, BLOCK_R=jagged_softmax.BLOCK_R, BLOCK_D=64))
    for t in ("fp32", "bf16") for b in (False, True)
} | {
    f"jagged_dense_bmm_{t}": (
        jagged_bmm._jagged_dense_kernel,
        {**_ptrs(t, "x_ptr", "y_ptr", "out_ptr"), **_ptrs("i32", "offsets_ptr", "tile_seq_ptr", "tile_start_ptr"),
         **dict.fromkeys(("num_items", "col_blocks", "k_dim", "n_dim", "max_len", "y_batch_stride", "y_k_stride",
                          "y_n_stride"), I32)},
        dict(BLOCK=jagged_attention.BLOCK, BLOCK_K=jagged_bmm.BLOCK_K, BLOCK_N=jagged_bmm.BLOCK_N))
    for t in ("fp32", "bf16")
} | {
    f"jagged_jagged_bmm_{t}": (
        jagged_bmm._jagged_jagged_kernel,
        {**_ptrs(t, "x_ptr", "y_ptr", "out_ptr"), "offsets_ptr": "*i32",
         **dict.fromkeys(("num_items", "m_blocks", "n_blocks", "m_dim", "n_dim", "max_len"), I32)},
        dict(BLOCK=jagged_attention.BLOCK, BLOCK_M=jagged_bmm.BLOCK_N, BLOCK_N=jagged_bmm.BLOCK_N))
    for t in ("fp32", "bf16")
} | {
    f"jagged_dense_{mode}_{t}": (
        jagged_dense._jagged_dense_kernel,
        {**_ptrs(t, "x_ptr", "y_ptr", "out_ptr"), **_ptrs("i32", "offsets_ptr", "tile_seq_ptr", "tile_start_ptr"),
         **dict.fromkeys(("num_items", "col_blocks", "dim", "padded_len"), I32)},
        dict(MODE=mode, BLOCK=jagged_attention.BLOCK, BLOCK_D=64))
    for t in ("fp32", "bf16") for mode in range(4)
}


def compile_for_sm90(name: str) -> None:
    kernel, types, constexprs = SPECS[name]
    signature = {arg: types.get(arg, "constexpr") for arg in kernel.arg_names}
    missing = [arg for arg, kind in signature.items() if kind == "constexpr" and arg not in constexprs]
    if missing:
        raise TypeError(f"no type or constexpr value for {missing}")
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    if not compiled.asm["cubin"]:
        raise RuntimeError("no cubin")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_compiles_for_sm90(compiled, name):
    assert compiled[name] is None, compiled[name]


if __name__ == "__main__":
    errors = {}
    for spec in SPECS:
        try:
            compile_for_sm90(spec)
            errors[spec] = None
        except Exception as exc:
            errors[spec] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    print(json.dumps(errors))
