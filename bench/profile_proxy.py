"""Where sfq-proxy's CPU goes per request: cProfile of the proxy serving wrk's load.

    python bench/profile_proxy.py [--mode json|stream] [--connections 16] [--seconds 5]
                                  [--top 30] [--sort tottime|cumulative|ncalls]

The proxy runs in this process under cProfile, on overhead.py's config, in front of
overhead.py's nginx backends, driven by wrk. Prints the top functions with their calls
*per request* (call counts, unlike times, do not depend on how busy the machine is) and
µs per request: the profile to read before changing the relay path.
Requires: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import tempfile
from pathlib import Path

import overhead
import uvloop

from sfq_proxy.config import load_config
from sfq_proxy.runner.server import GC_THRESHOLDS, running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["json", "stream"], default="json")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument("--save", type=Path, help="also write the raw profile here (pstats)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "proxy.yaml").write_text(overhead.proxy_config(modes=(args.mode,)))
        with overhead.nginx_backends(work, [args.mode]):
            profile, requests = uvloop.run(_serve(work, args))
    stats = pstats.Stats(profile).sort_stats(args.sort)
    if args.save:
        stats.dump_stats(args.save)
    print(f"{requests} requests ({args.mode}, c={args.connections}); per request:")
    print(f"{'calls':>7} {'tot µs':>7} {'cum µs':>7}  function")
    for func in stats.fcn_list[: args.top]:  # type: ignore[attr-defined]
        calls, _, tottime, cumtime, _ = stats.stats[func]  # type: ignore[attr-defined]
        where = f"{Path(func[0]).name}:{func[1]}({func[2]})"
        print(f"{calls / requests:>7.2f} {tottime / requests * 1e6:>7.1f} "
              f"{cumtime / requests * 1e6:>7.1f}  {where}")  # fmt: skip


async def _serve(work: Path, args: argparse.Namespace) -> tuple[cProfile.Profile, int]:
    config = load_config(work / "proxy.yaml")
    async with running(config):
        gc.freeze()  # as `serve` does once serving
        gc.set_threshold(*GC_THRESHOLDS)
        loop = asyncio.get_running_loop()
        url = f"http://127.0.0.1:{overhead.PROXY_PORT}"
        model = f"bench-{args.mode}"
        await loop.run_in_executor(None, overhead.wrk, url, model, args.connections, 1, work)
        profile = cProfile.Profile()
        profile.enable()
        result = await loop.run_in_executor(
            None, overhead.wrk, url, model, args.connections, args.seconds, work
        )
        profile.disable()
    return profile, int(result["requests"])


if __name__ == "__main__":
    main()
