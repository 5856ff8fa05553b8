"""Print a kernel's source: ``python -m orda_tp.kernels grads --kl-divergence reverse``.

``python -m orda_tp.kernels cache`` prints the kernel cache directory (``ORDA_TP_KERNEL_CACHE``,
where generated modules are written only when it is set) and the generated files in it. See
:func:`orda_tp.kernels.print_kernel`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .cache import CACHE_ENV, kernel_cache_dir
from .source import KERNELS, kernel_source


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orda_tp.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=[*KERNELS, "cache"], help="the kernel to print, or cache")
    parser.add_argument("--kl-divergence", help="the variant whose generated functions to print (sums, grads)")
    parser.add_argument("--kl-alpha", type=float, help="the variant's kl_alpha")
    parser.add_argument("--kl-beta", type=float, help="the variant's kl_beta")
    args = parser.parse_args(argv)
    if args.kernel == "cache":
        directory = kernel_cache_dir()
        if directory is None:
            print(f"{CACHE_ENV} is not set: generated kernel modules run from memory and no file is written")
            return 0
        print(directory)
        for path in sorted(directory.glob("*.py")):
            print(f"  {path.name}")
        return 0
    try:
        text = kernel_source(args.kernel, args.kl_divergence, kl_alpha=args.kl_alpha, kl_beta=args.kl_beta)
    except ValueError as error:
        parser.error(str(error))
    except ImportError as error:  # triton is not installed: its install line, without a traceback
        raise SystemExit(f"{parser.prog}: {error}") from error
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
