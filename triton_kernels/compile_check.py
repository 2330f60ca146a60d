"""Compile every registered Triton kernel for a real GPU target, with no GPU.

Run as ``python -m pasta_engine.triton_kernels.compile_check [ARCH]`` (ARCH: 90 by default; the
test suite does this in a subprocess). Importing ``pasta_engine`` turns Triton's interpreter on
when there is no GPU, and interpreted kernels cannot be compiled, so when ``TRITON_INTERPRET`` is
on the command runs itself again with it off. Prints one line per specialization and exits
non-zero if any fails to compile to a cubin.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time


def main(argv: list[str] | None = None) -> int:
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # the kernels were defined for the interpreter: start again with it off, before any import
        argv = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, "-m", "pasta_engine.triton_kernels.compile_check", *argv],
                  {**os.environ, "TRITON_INTERPRET": "0"})
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    import pasta_engine.triton_kernels as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "compile_check":
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
    arch = int((argv or sys.argv[1:] or ["90"])[0])
    target = GPUTarget("cuda", arch, 32)
    failed = 0
    for spec in pkg.COMPILE_SPECS:
        t = time.perf_counter()
        try:
            src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
            k = compile(src, target=target, options=spec.options or None)
            ok = "cubin" in k.asm
            print(f"ok   {spec.name}: sm_{arch} cubin {len(k.asm['cubin'])} bytes, {time.perf_counter() - t:.1f} s")
            failed += not ok
        except Exception as e:  # report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {spec.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    print(f"{len(pkg.COMPILE_SPECS) - failed} compiled, {failed} failed")
    return 1 if failed or not pkg.COMPILE_SPECS else 0


if __name__ == "__main__":
    sys.exit(main())
