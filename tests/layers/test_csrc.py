"""The optional CUDA C++ extension (csrc/, CMakeLists.txt, pasta_engine/layers/csrc_ops.py).

CPU / CI: every csrc/kernels/*.cu compiles with nvcc for sm_90, the CMake kernels-only build
works, the torch binding compiles against torch's headers, the pure-torch references are right
(the LSE merge against a softmax over all keys; the RoPE + KV write against the attention
backend), and the wrappers reject bad input and name the build command when the extension is
missing. GPU (``-m gpu``): the extension is built with CMake, loaded, and both ops match the
references in float32 / float16 / bfloat16, eagerly and replayed from a CUDA graph.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pasta_engine.layers import csrc_ops
from pasta_engine.layers.reference_attention import TorchAttention
from pasta_engine.layers.rotary import apply_rope

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted((ROOT / "csrc" / "kernels").glob("*.cu"))
LAUNCHERS = ("pasta::launch_rope_kv_write", "pasta::launch_lse_merge")


def _nvcc() -> str:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    pytest.skip("nvcc not found (install the CUDA toolkit or set CUDACXX) to compile csrc/")


def _cuda_include_dir(nvcc: str) -> Path:
    """The toolkit's include directory (with cuda_runtime.h), as nvcc itself reports it."""
    dry = _run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull])
    cands = [Path(m) for m in re.findall(r'INCLUDES="-I([^"]+)"', dry.stdout + dry.stderr)]
    cands += [Path(nvcc).resolve().parents[1] / "include", Path("/usr/local/cuda/include")]
    for cand in cands:
        if (cand / "cuda_runtime.h").is_file():
            return cand
    pytest.skip(f"no cuda_runtime.h found next to {nvcc} (looked in {[str(c) for c in cands]})")


def _run(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _defined_symbols(paths: list[Path]) -> str:
    """Demangled defined text symbols of object files / archives ("" when nm is missing)."""
    if shutil.which("nm") is None:
        return ""
    return "\n".join(_run(["nm", "-C", "--defined-only", str(p)]).stdout for p in paths)


# ---------------------------------------------------------------------------------------------
# compile checks (no GPU needed)


def test_kernel_sources_do_not_include_torch():
    assert KERNELS, "no csrc/kernels/*.cu found"
    for path in sorted((ROOT / "csrc" / "kernels").iterdir()):
        includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', path.read_text())
        bad = [i for i in includes if i.split("/")[0] in ("torch", "ATen", "c10", "pybind11", "Python.h")]
        assert not bad, f"{path.name} includes torch headers {bad}: only csrc/torch_ops.cpp may"


def test_kernels_compile_with_nvcc_for_sm90(tmp_path):
    nvcc = _nvcc()

    def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
        obj = tmp_path / (src.stem + ".o")
        cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-O3", "-c", str(src), "-o", str(obj),
               "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra"]
        return obj, _run(cmd)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, KERNELS))
    for src, (obj, proc) in zip(KERNELS, results):
        assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{proc.stderr[-4000:]}"
        assert obj.stat().st_size > 0
    symbols = _defined_symbols([obj for obj, _ in results])
    for name in LAUNCHERS if symbols else ():
        assert name in symbols, f"{name} is not defined by any compiled kernel file"


def test_cmake_kernels_only_build(tmp_path):
    nvcc = _nvcc()
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: the CMake build check needs it (apt-get install cmake)")
    build = tmp_path / "build"
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={nvcc}",
           f"-DPython3_EXECUTABLE={sys.executable}", f"-DPASTA_OUTPUT_DIR={tmp_path / 'out'}"]
    if torch.version.cuda is not None:
        cmd.append("-DPASTA_TORCH_EXTENSION=OFF")  # the GPU tests build the extension
    conf = _run(cmd)
    assert conf.returncode == 0, f"cmake configure failed:\n{conf.stdout[-3000:]}\n{conf.stderr[-3000:]}"
    if torch.version.cuda is None:  # the automatic default must see a CPU torch and skip the extension
        assert "is a CPU build: kernels only" in conf.stdout, conf.stdout[-3000:]
    assert "torch extension not built" in conf.stdout
    proc = _run(["cmake", "--build", str(build), "-j", str(max(2, os.cpu_count() or 2))])
    assert proc.returncode == 0, f"cmake build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    lib = build / "libpasta_kernels.a"
    assert lib.is_file() and lib.stat().st_size > 0
    symbols = _defined_symbols([lib])
    for name in LAUNCHERS if symbols else ():
        assert name in symbols
    assert not (tmp_path / "out").exists(), "a kernels-only build must not produce the extension"


def test_torch_binding_compiles_against_torch_headers(tmp_path):
    """csrc/torch_ops.cpp compiles (syntax and templates) with the host compiler against the
    installed torch's headers. CPU wheels ship the c10/cuda headers but not the generated
    c10/cuda/impl/cuda_cmake_macros.h; a stand-in with its one define is written to tmp."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler (c++ / g++) to compile csrc/torch_ops.cpp")
    nvcc = _nvcc()
    inc = Path(torch.utils.cmake_prefix_path).parents[1] / "include"
    if not (inc / "c10" / "cuda" / "CUDAStream.h").is_file():
        pytest.skip(f"torch at {inc} ships no c10/cuda headers to compile csrc/torch_ops.cpp against")
    shim: list[str] = []
    if not (inc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        (tmp_path / "c10" / "cuda" / "impl").mkdir(parents=True)
        (tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        shim = ["-isystem", str(tmp_path)]
    cuda_inc = _cuda_include_dir(nvcc)
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *shim,
           "-isystem", str(inc), "-isystem", str(inc / "torch" / "csrc" / "api" / "include"),
           "-isystem", str(cuda_inc), "-I", str(ROOT / "csrc"), str(ROOT / "csrc" / "torch_ops.cpp")]
    proc = _run(cmd)
    assert proc.returncode == 0, f"csrc/torch_ops.cpp does not compile:\n{proc.stderr[-4000:]}"


# ---------------------------------------------------------------------------------------------
# references (CPU)


def _split_attention(q, keys, vals, cuts):
    """Partials of attention of q [H, D] over keys/vals [L, H, D] split at `cuts`: float64
    (o [n, H, D], lse [n, H]); an empty piece gets lse -inf and o NaN."""
    bounds = [0, *cuts, keys.shape[0]]
    os_, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            os_.append(torch.full_like(q, float("nan")))
            lses.append(torch.full(q.shape[:1], float("-inf"), dtype=q.dtype))
            continue
        s = torch.einsum("hd,lhd->hl", q, keys[a:b])
        os_.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vals[a:b]))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(os_), torch.stack(lses)


def _merge_problem(seed: int, h: int = 3, d: int = 16):
    """Rows of random attention problems split into random pieces (some empty), their partials
    shuffled into one [S, H, D] pool. Returns part_o, part_lse, row_indptr, row_parts and the
    float64 truth (out [R, H, D], lse [R, H]) from a softmax over each row's whole key set."""
    g = torch.Generator().manual_seed(seed)
    kinds = ["normal"] * 5 + ["no_parts", "all_empty", "one_key", "out_of_range"]
    parts_o, parts_lse, owner = [], [], []
    truth_o, truth_lse = [], []
    for r, kind in enumerate(kinds):
        q = torch.randn(h, d, generator=g, dtype=torch.float64) * 2
        if kind == "no_parts":
            truth_o.append(torch.zeros(h, d, dtype=torch.float64))
            truth_lse.append(torch.full((h,), float("-inf"), dtype=torch.float64))
            continue
        if kind == "all_empty":
            o = torch.full((2, h, d), float("nan"), dtype=torch.float64)
            lse = torch.full((2, h), float("-inf"), dtype=torch.float64)
            truth_o.append(torch.zeros(h, d, dtype=torch.float64))
            truth_lse.append(torch.full((h,), float("-inf"), dtype=torch.float64))
        else:
            n = 1 if kind == "one_key" else int(torch.randint(2, 40, (1,), generator=g))
            keys = torch.randn(n, h, d, generator=g, dtype=torch.float64)
            vals = torch.randn(n, h, d, generator=g, dtype=torch.float64)
            n_cuts = int(torch.randint(0, 5, (1,), generator=g))
            cuts = sorted(torch.randint(0, n + 1, (n_cuts,), generator=g).tolist())
            cuts += [cuts[-1]] if cuts else [0]  # at least one empty piece in every row
            o, lse = _split_attention(q, keys, vals, cuts)
            s = torch.einsum("hd,lhd->hl", q, keys)
            truth_o.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vals))
            truth_lse.append(torch.logsumexp(s, -1))
        parts_o.append(o)
        parts_lse.append(lse)
        owner += [r] * o.shape[0]
    part_o = torch.cat(parts_o).float()
    part_lse = torch.cat(parts_lse).float()
    perm = torch.randperm(part_o.shape[0], generator=g)  # pool position of each partial
    pool_o, pool_lse = torch.empty_like(part_o), torch.empty_like(part_lse)
    pool_o[perm], pool_lse[perm] = part_o, part_lse
    owner = torch.tensor(owner)
    parts_per_row = [perm[owner == r].tolist() for r in range(len(kinds))]
    s_total = part_o.shape[0]
    oor = kinds.index("out_of_range")
    parts_per_row[oor] += [-1, s_total, s_total + 7]  # ignored
    row_indptr = torch.tensor([0] + [len(x) for x in parts_per_row]).cumsum(0).to(torch.int32)
    row_parts = torch.tensor([s for x in parts_per_row for s in x], dtype=torch.int32)
    return pool_o, pool_lse, row_indptr, row_parts, torch.stack(truth_o), torch.stack(truth_lse)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lse_merge_reference_equals_softmax_over_all_keys(seed):
    part_o, part_lse, indptr, parts, truth_o, truth_lse = _merge_problem(seed)
    r, h, d = truth_o.shape
    assert torch.isnan(part_o).any(), "the problem must contain empty pieces with NaN outputs"
    out = torch.full((r, h, d), 123.0)
    out_lse = torch.full((r, h), 123.0)
    ret = csrc_ops.lse_merge_reference(part_o, part_lse, indptr, parts, out, out_lse)
    assert ret is out
    torch.testing.assert_close(out.double(), truth_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_lse.double(), truth_lse, rtol=1e-5, atol=1e-5)  # -inf rows equal too
    # half-precision outputs are the float32 result rounded once
    for dtype in (torch.float16, torch.bfloat16):
        low = torch.empty(r, h, d, dtype=dtype)
        csrc_ops.lse_merge_reference(part_o, part_lse, indptr, parts, low)
        assert torch.equal(low, out.to(dtype))


def test_lse_merge_still_takes_the_old_row_slots_keyword():
    """``row_parts`` was called ``row_slots`` ("slot" now names only KV-cache slots): the old
    keyword still works, and giving both is an error."""
    part_o, part_lse, indptr, parts, truth_o, _ = _merge_problem(0)
    new, old = torch.empty(truth_o.shape), torch.empty(truth_o.shape)
    csrc_ops.lse_merge_reference(part_o, part_lse, indptr, row_parts=parts, out=new)
    csrc_ops.lse_merge_reference(part_o, part_lse, indptr, row_slots=parts, out=old)
    assert torch.equal(new, old)
    with pytest.raises(TypeError, match="both row_slots= and its new name row_parts="):
        csrc_ops.lse_merge_reference(part_o, part_lse, indptr, row_parts=parts, row_slots=parts, out=old)


def test_rope_pair_formula_is_rotate_half():
    """The kernel's per-pair formula (rope_kv_write.cuh) equals apply_rope's rotate-half."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g)
    cos, sin = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    torch.testing.assert_close(_rope_pairs_fp32(x, cos, sin), apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)


def _rope_pairs_fp32(x, cos, sin):
    """out[i] = x[i] c[i] - x[i+D/2] s[i]; out[i+D/2] = x[i+D/2] c[i+D/2] + x[i] s[i+D/2], in fp32."""
    x, cos, sin = x.float(), cos.float()[:, None], sin.float()[:, None]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos[..., :h] - x2 * sin[..., :h], x2 * cos[..., h:] + x1 * sin[..., h:]], -1)


def _rope_problem(t, hq, hkv, d, dtype, device, *, seed=0, misaligned=False, pad=True, pages=6, page_size=16):
    """q/k/v as column slices of a fused qkv buffer (row stride padded by 8 elements, so
    16-byte aligned when the widths allow; ``misaligned`` shifts them one element off),
    cos/sin at random positions, 4-D caches that are one layer of a 6-D KV tensor, and a
    slot mapping of distinct slots, with a padding entry (-1) when ``pad`` and t > 2."""
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    buf = torch.randn(t, width + 8, generator=g).to(dtype).to(device)
    qkv = buf[:, 1 : width + 1] if misaligned else buf[:, :width]
    q = qkv[:, : hq * d].unflatten(1, (hq, d))
    k = qkv[:, hq * d : (hq + hkv) * d].unflatten(1, (hkv, d))
    v = qkv[:, (hq + hkv) * d :].unflatten(1, (hkv, d))
    pos = torch.randint(0, 4096, (t,), generator=g).double()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, -1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    kv = torch.randn(2, 2, pages, page_size, hkv, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(pages * page_size, generator=g)[:t]
    if pad and t > 2:
        slots[t // 2] = -1
    return q, k, v, cos, sin, kv, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write_reference_equals_attention_backend(dtype):
    q, k, v, cos, sin, kv, slots = _rope_problem(9, 4, 2, 16, dtype, "cpu", pad=False)  # no padding rule there
    kv_a, kv_b = kv.clone(), kv.clone()
    q_a = TorchAttention().rope_and_write(q, k, v, cos, sin, kv_a[1, 0], kv_a[1, 1], slots)
    q_b = csrc_ops.rope_kv_write_reference(q, k, v, cos, sin, kv_b[1, 0], kv_b[1, 1], slots)
    assert torch.equal(q_a, q_b)
    assert torch.equal(kv_a, kv_b)
    assert not torch.equal(kv_a, kv), "the write must change the cache"


def test_rope_kv_write_reference_skips_padded_slots():
    q, k, v, cos, sin, kv, slots = _rope_problem(7, 2, 2, 8, torch.float32, "cpu", pages=2, page_size=8)
    slots[1] = 16  # == num_slots: out of range, skipped like -1
    before = kv.clone()
    csrc_ops.rope_kv_write_reference(q, k, v, cos, sin, kv[0, 0], kv[0, 1], slots)
    kc, vc = kv[0, 0].reshape(-1, 2, 8), kv[0, 1].reshape(-1, 2, 8)
    written = [(i, int(s)) for i, s in enumerate(slots) if 0 <= s < 16]
    assert len(written) == 5
    for i, s in written:
        torch.testing.assert_close(kc[s], apply_rope(k, cos, sin)[i])
        assert torch.equal(vc[s], v[i])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[s for _, s in written]] = False
    assert torch.equal(kc[untouched], before[0, 0].reshape(-1, 2, 8)[untouched])
    assert torch.equal(kv[1], before[1]), "another layer was written"


# ---------------------------------------------------------------------------------------------
# wrappers: validation, availability (CPU)


def test_wrappers_reject_bad_shapes_and_dtypes():
    q, k, v, cos, sin, kv, slots = _rope_problem(4, 2, 1, 8, torch.float32, "cpu")
    kc, vc = kv[0, 0], kv[0, 1]
    with pytest.raises(ValueError, match="cos must be"):
        csrc_ops.rope_kv_write(q, k, v, cos[:, :4], sin, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        csrc_ops.rope_kv_write(q, k, v, cos, sin, kc, vc, slots.int())
    with pytest.raises(ValueError, match="k_cache must be"):
        csrc_ops.rope_kv_write(q, k, v, cos, sin, kc[..., :4], vc, slots)
    with pytest.raises(ValueError, match="sin must have q's dtype"):
        csrc_ops.rope_kv_write(q, k, v, cos, sin.half(), kc, vc, slots)
    with pytest.raises(ValueError, match="head_dim must be even"):
        csrc_ops.rope_kv_write(q[..., :7], k[..., :7], v[..., :7], cos[:, :7], sin[:, :7], kc, vc, slots)
    part_o, part_lse, indptr, rs, truth, _ = _merge_problem(0)
    out = torch.empty(truth.shape)
    with pytest.raises(ValueError, match="part_lse must be"):
        csrc_ops.lse_merge(part_o, part_lse[:, :1], indptr, rs, out)
    with pytest.raises(ValueError, match="row_indptr and row_parts must be int32"):
        csrc_ops.lse_merge(part_o, part_lse, indptr.long(), rs, out)
    with pytest.raises(ValueError, match="row_indptr must be"):
        csrc_ops.lse_merge(part_o, part_lse, indptr[:-1], rs, out)
    with pytest.raises(ValueError, match="out_lse must be"):
        csrc_ops.lse_merge(part_o, part_lse, indptr, rs, out, torch.empty(truth.shape[:2], dtype=torch.float64))
    with pytest.raises(ValueError, match="part_o and part_lse must be float32"):
        csrc_ops.lse_merge_reference(part_o.half(), part_lse, indptr, rs, out)


@pytest.fixture
def fresh_state(monkeypatch):
    """csrc_ops's load state reset for one test (restored afterwards)."""
    for key, val in (("tried", False), ("ok", False), ("reason", ""), ("path", None)):
        monkeypatch.setitem(csrc_ops._STATE, key, val)
    return monkeypatch


def test_missing_extension_names_the_build_command(fresh_state):
    fresh_state.setitem(csrc_ops._STATE, "tried", True)
    fresh_state.setitem(csrc_ops._STATE, "reason", "extension not built (x not found)")
    q, k, v, cos, sin, kv, slots = _rope_problem(3, 2, 1, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=re.escape(csrc_ops.BUILD_COMMAND)):
        csrc_ops.rope_kv_write(q, k, v, cos, sin, kv[0, 0], kv[0, 1], slots)
    part_o, part_lse, indptr, rs, truth, _ = _merge_problem(0)
    with pytest.raises(RuntimeError, match="not built"):
        csrc_ops.lse_merge(part_o, part_lse, indptr, rs, torch.empty(truth.shape))


def test_available_is_false_on_cpu_torch(fresh_state):
    fresh_state.setattr(torch.version, "cuda", None)
    assert csrc_ops.available() is False
    assert "CPU-only" in csrc_ops.unavailable_reason()


def test_available_is_false_when_not_built_or_unloadable(fresh_state, tmp_path):
    fresh_state.setattr(torch.version, "cuda", "12.8")
    fresh_state.setenv("PASTA_ENGINE_CSRC_LIB", str(tmp_path / "_C.so"))
    assert csrc_ops.library_path() is None
    assert csrc_ops.available() is False
    assert "not built" in csrc_ops.unavailable_reason()
    (tmp_path / "_C.so").write_bytes(b"not an ELF file")
    fresh_state.setitem(csrc_ops._STATE, "tried", False)
    assert csrc_ops.library_path() == tmp_path / "_C.so"
    assert csrc_ops.available() is False
    assert "loading" in csrc_ops.unavailable_reason() and "failed" in csrc_ops.unavailable_reason()


# ---------------------------------------------------------------------------------------------
# GPU: build, load, compare with the references


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """The extension, freshly built from csrc/ with CMake into a tmp dir and loaded (or the one
    this process already loaded: a namespace can be registered only once)."""
    if not csrc_ops._STATE["ok"]:
        nvcc = _nvcc()
        if shutil.which("cmake") is None:
            pytest.skip("cmake not found: needed to build the extension")
        tmp = tmp_path_factory.mktemp("csrc_ext")
        conf = _run(["cmake", "-S", str(ROOT), "-B", str(tmp / "build"), f"-DCMAKE_CUDA_COMPILER={nvcc}",
                     f"-DPython3_EXECUTABLE={sys.executable}", "-DPASTA_TORCH_EXTENSION=ON",
                     f"-DPASTA_OUTPUT_DIR={tmp / 'out'}"])
        assert conf.returncode == 0, f"cmake configure failed:\n{conf.stdout[-4000:]}\n{conf.stderr[-4000:]}"
        build = _run(["cmake", "--build", str(tmp / "build"), "-j", str(os.cpu_count() or 4)], timeout=900)
        assert build.returncode == 0, f"cmake build failed:\n{build.stdout[-6000:]}\n{build.stderr[-3000:]}"
        lib = tmp / "out" / "_C.so"
        assert lib.is_file(), f"the build did not produce {lib}"
        os.environ["PASTA_ENGINE_CSRC_LIB"] = str(lib)
        csrc_ops._STATE.update(tried=False, ok=False, reason="", path=None)
    assert csrc_ops.available(), csrc_ops.unavailable_reason()
    return csrc_ops


@pytest.mark.gpu
def test_extension_registers_ops_with_mutation_schema(ext):
    schema = str(torch.ops.pasta_engine.rope_kv_write.default._schema)
    assert "Tensor(a!) k_cache" in schema and "Tensor(b!) v_cache" in schema and schema.endswith("-> Tensor")
    schema = str(torch.ops.pasta_engine.lse_merge.default._schema)
    assert "Tensor(a!) out" in schema and "Tensor? out_lse" in schema


SHAPES = [(32, 8, 128), (9, 3, 64), (3, 1, 10)]  # Llama-3-8B, SmolLM2-135M, odd D/2 (scalar path)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ulp_close(actual, expected, dtype):
    """Equal up to one rounding to `dtype` (fp32: up to FMA contraction)."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=1e-5)


def _ref_tol(dtype) -> dict:
    """The torch reference rounds after each of its ops: a few ulps from the fused kernel."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("misaligned", [False, True])
def test_rope_kv_write_matches_reference(ext, dtype, shape, t, misaligned):
    hq, hkv, d = shape
    q, k, v, cos, sin, kv, slots = _rope_problem(t, hq, hkv, d, dtype, "cuda", seed=t, misaligned=misaligned)
    kv_ext, kv_ref = kv.clone(), kv.clone()
    q_ext = ext.rope_kv_write(q, k, v, cos, sin, kv_ext[1, 0], kv_ext[1, 1], slots)
    q_ref = ext.rope_kv_write_reference(q, k, v, cos, sin, kv_ref[1, 0], kv_ref[1, 1], slots)
    torch.cuda.synchronize()
    assert q_ext.shape == (t, hq, d) and q_ext.dtype == dtype and q_ext.is_contiguous()
    # one rounding of the fp32 result
    _ulp_close(q_ext, _rope_pairs_fp32(q, cos, sin).to(dtype), dtype)
    written = slots >= 0
    kc_ext = kv_ext[1, 0].reshape(-1, hkv, d)
    _ulp_close(kc_ext[slots[written]], _rope_pairs_fp32(k, cos, sin)[written].to(dtype), dtype)
    assert torch.equal(kv_ext[1, 1].reshape(-1, hkv, d)[slots[written]], v[written])
    # the reference rounds after each torch op: a few ulps apart at most
    torch.testing.assert_close(q_ext, q_ref, **_ref_tol(dtype))
    torch.testing.assert_close(kv_ext, kv_ref, **_ref_tol(dtype))  # unwritten slots and layers: equal
    untouched = torch.ones(kc_ext.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[written]] = False
    assert torch.equal(kc_ext[untouched], kv[1, 0].reshape(-1, hkv, d)[untouched])
    assert torch.equal(kv_ext[0], kv[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [128, 64, 10])
@pytest.mark.parametrize("misaligned", [False, True])
def test_lse_merge_matches_reference(ext, dtype, d, misaligned):
    part_o, part_lse, indptr, parts, _, _ = _merge_problem(d, h=9, d=d)
    s, h = part_lse.shape
    if misaligned:  # part_o one element off 16-byte alignment: scalar loads
        buf = torch.empty(s, h, d + 1)
        buf[..., 1:] = part_o
        part_o = buf[..., 1:]
    part_o, part_lse, indptr, parts = (x.cuda() for x in (part_o, part_lse, indptr, parts))
    r = indptr.shape[0] - 1
    out = torch.full((r, h, d), 7.0, dtype=dtype, device="cuda")
    out_lse = torch.full((r, h), 7.0, device="cuda")
    ref = torch.empty(r, h, d, device="cuda")
    ref_lse = torch.empty(r, h, device="cuda")
    ext.lse_merge(part_o, part_lse, indptr, parts, out, out_lse)
    ext.lse_merge_reference(part_o, part_lse, indptr, parts, ref, ref_lse)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        _ulp_close(out, ref.to(dtype), dtype)
    torch.testing.assert_close(out_lse, ref_lse, rtol=1e-5, atol=1e-5)
    out2 = torch.zeros_like(out)
    ext.lse_merge(part_o, part_lse, indptr, parts, out2)  # out_lse is optional
    assert torch.equal(out2, out)


@pytest.mark.gpu
def test_ops_replay_from_cuda_graph(ext):
    dtype, (hq, hkv, d), t = torch.bfloat16, (32, 8, 128), 16
    q, k, v, cos, sin, kv, slots = _rope_problem(t, hq, hkv, d, dtype, "cuda", seed=1)
    part_o, part_lse, indptr, rs, _, _ = _merge_problem(3, h=hq, d=d)
    part_o, part_lse, indptr, rs = (x.cuda() for x in (part_o, part_lse, indptr, rs))
    r = indptr.shape[0] - 1
    out = torch.empty(r, hq, d, dtype=dtype, device="cuda")
    out_lse = torch.empty(r, hq, device="cuda")
    kc, vc = kv[1, 0], kv[1, 1]

    def step():
        q_rot = ext.rope_kv_write(q, k, v, cos, sin, kc, vc, slots)
        ext.lse_merge(part_o, part_lse, indptr, rs, out, out_lse)
        return q_rot

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_static = step()

    for seed in (5, 6):  # new inputs in the same buffers, then replay
        q2, k2, v2, cos2, sin2, kv2, slots2 = _rope_problem(t, hq, hkv, d, dtype, "cuda", seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2), (cos, cos2), (sin, sin2), (kv, kv2), (slots, slots2)):
            dst.copy_(src)
        po2, pl2, _, _, _, _ = _merge_problem(3, h=hq, d=d)  # same row structure, other values
        part_o.copy_(po2.cuda() * seed)
        part_lse.copy_(pl2.cuda() - seed)
        kv_ref = kv.clone()
        q_ref = ext.rope_kv_write_reference(q, k, v, cos, sin, kv_ref[1, 0], kv_ref[1, 1], slots)
        ref = torch.empty(r, hq, d, device="cuda")
        ref_lse = torch.empty(r, hq, device="cuda")
        ext.lse_merge_reference(part_o, part_lse, indptr, rs, ref, ref_lse)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(q_static, q_ref, **_ref_tol(dtype))
        torch.testing.assert_close(kv, kv_ref, **_ref_tol(dtype))
        _ulp_close(out, ref.to(dtype), dtype)
        torch.testing.assert_close(out_lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_ops_check_inputs_in_cpp(ext):
    """The TORCH_CHECKs of csrc/torch_ops.cpp name the bad argument (calling the op directly,
    past the Python validation)."""
    q, k, v, cos, sin, kv, slots = _rope_problem(4, 2, 1, 8, torch.float16, "cuda")
    op = torch.ops.pasta_engine.rope_kv_write
    with pytest.raises(RuntimeError, match="cos must be"):
        op(q, k, v, cos.float(), sin, kv[0, 0], kv[0, 1], slots)
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        op(q, k, v, cos, sin, kv[0, 0], kv[0, 1], slots.int())
    with pytest.raises(RuntimeError, match="q must be a CUDA tensor"):
        op(q.cpu(), k, v, cos, sin, kv[0, 0], kv[0, 1], slots)
    part_o, part_lse, indptr, rs, truth, _ = _merge_problem(0)
    part_o, part_lse, indptr, rs = (x.cuda() for x in (part_o, part_lse, indptr, rs))
    with pytest.raises(RuntimeError, match="row_parts must be torch.int32"):
        torch.ops.pasta_engine.lse_merge(part_o, part_lse, indptr, rs.long(), torch.empty(truth.shape, device="cuda"),
                                         None)
