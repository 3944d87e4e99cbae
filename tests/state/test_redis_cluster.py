"""``state: {redis: URL, cluster: true}`` on a real Redis Cluster: three primaries of
Debian's redis-server (``RedisClusterNodes``), the proxies given the URL of one node that
holds none of their state. Each pool's keys, its functions and its calls are on the primary
that owns its slot, reached without a redirection; two pools on two shards serve at once,
and the proxies sharing them are one fairness domain; an org's rpm holds across proxies on
its own shard; a shard that comes back empty is joined again."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml
from proxy_lab import MODEL, Lab, Served, config_yaml, eventually
from redis.crc import key_slot
from redis_server import (
    RedisClusterNode,
    RedisClusterNodes,
    need_redis_server,
    queued_is,
    running_redis_cluster,
)
from test_shared_state import CHAT, PER_ORG, out_of_bound, skewed_flood

from sfq_proxy.config import Config, parse_config
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.state.redis_calibration import KEY as CALIBRATION_KEY
from sfq_proxy.state.redis_dispatch import pool_prefix

pytestmark = pytest.mark.redis
OTHER_MODEL = "sim-other"  # the model of the pool ``other``
TTL_S = 1.5  # where a test waits for a lease to lapse
CALM_TTL_S = 30  # elsewhere: a loaded machine may stall the loop (shared with clients) 1.5 s
ORG_A = "sfq:{org:A}:"  # org A's admission keys


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A real 3-primary Redis Cluster for this module (Debian's package, from `make tools`)."""
    need_redis_server()
    with running_redis_cluster() as cluster:
        yield cluster


@pytest.fixture
def cluster(redis_cluster: RedisClusterNodes) -> RedisClusterNodes:
    """The module's cluster with no keys, no functions and its statistics at zero."""
    redis_cluster.reset()
    return redis_cluster


def shards(
    cluster: RedisClusterNodes,
) -> tuple[RedisClusterNode, RedisClusterNode, RedisClusterNode]:
    """The primaries of pool ``sim`` and pool ``other``, and the third, which holds neither
    (the node the proxies are given). The slots are redis-py's, checked against the
    cluster's own; the owners are the cluster's (CLUSTER SLOTS)."""
    slots = {pool: key_slot(pool_prefix(pool).encode()) for pool in ("sim", "other")}
    with cluster.nodes[0].client() as client:
        for pool, slot in slots.items():
            assert client.cluster("KEYSLOT", pool_prefix(pool)) == slot
    assert slots["sim"] != slots["other"]
    sim, other = cluster.owner(pool_prefix("sim")), cluster.owner(pool_prefix("other"))
    assert sim is not other, "both pools on one shard: the test would show no spreading"
    entry = next(node for node in cluster.nodes if node not in (sim, other))
    return sim, other, entry


def two_pools(
    sim: SimBackend,
    other: SimBackend,
    entry: RedisClusterNode,
    ttl_s: float = CALM_TTL_S,
    **options: Any,
) -> Config:
    """Pools ``sim`` (MODEL, 1 slot) and ``other`` (OTHER_MODEL, 2 slots) sharing their
    state in the cluster, whose only node named is ``entry``."""
    state = {"redis": f"redis://127.0.0.1:{entry.port}", "cluster": True, "lease_ttl_s": ttl_s}
    data = yaml.safe_load(config_yaml([sim.url], slots=1, state=state, **options))
    backends = [{"url": other.url, "slots": 2}]
    data["pools"]["other"] = {**data["pools"]["sim"], "models": [OTHER_MODEL], "backends": backends}
    return parse_config(yaml.safe_dump(data), environ={})


def tags_on(node: RedisClusterNode) -> set[str]:
    """The hash tags of the ``sfq:`` keys the node holds: its pools, and ``org:<org>``."""
    with node.client() as client:
        return {key.split("{", 1)[1].split("}", 1)[0] for key in client.scan_iter("sfq:*")}


def libraries(node: RedisClusterNode) -> set[str]:
    """The names of the function libraries the node holds, without the digest of their code
    that ``state/redis_functions.py`` adds (``sfq_<digest>`` is "sfq")."""
    with node.client() as client:
        return {
            dict(zip(lib[::2], lib[1::2], strict=True))["library_name"].rsplit("_", 1)[0]
            for lib in client.function_list()
        }


def calls(node: RedisClusterNode) -> dict[str, int]:
    """What the node was asked since the reset: FCALLs, COMMAND GETKEYS (a client looking
    for a command's keys), and the MOVED and ASK redirections it answered."""
    with node.client() as client:
        commands, errors = client.info("commandstats"), client.info("errorstats")
    return {
        "fcall": commands.get("cmdstat_fcall", {}).get("calls", 0),
        "getkeys": commands.get("cmdstat_command|getkeys", {}).get("calls", 0),
        "moved": errors.get("errorstat_MOVED", {}).get("count", 0),
        "ask": errors.get("errorstat_ASK", {}).get("count", 0),
    }


async def ask(lab: Lab, proxy: Served, org: str, model: str = MODEL, tokens: int = 2) -> str:
    try:
        reply = await lab.client(proxy, org).chat.completions.create(
            model=model, messages=CHAT, max_tokens=tokens
        )
    except openai.APIStatusError as err:
        return f"{err.status_code} {err.body and err.body.get('code')}"  # type: ignore[union-attr]
    assert reply.usage is not None
    return f"ok {reply.usage.completion_tokens}"


async def test_two_pools_on_two_shards_one_fairness_domain_across_two_proxies(
    lab: Lab, cluster: RedisClusterNodes
) -> None:
    """Pool ``sim`` (one slot) flooded 4:1 through two proxies while pool ``other`` serves
    through both: the weights and the slot hold across the proxies, each pool's state and
    functions are on its own primary (none on the node the proxies were given), and every
    call went straight to the primary that owns its key: no MOVED, no ASK, no key lookup."""
    sim_owner, other_owner, entry = shards(cluster)
    sim = await lab.backend(max_num_seqs=4)
    other = await lab.backend(models=[OTHER_MODEL])
    config = two_pools(sim, other, entry, orgs={"A": {"weight": 4}})
    proxies = [await lab.proxy(config) for _ in range(2)]

    beside = asyncio.gather(
        *(ask(lab, p, org, OTHER_MODEL, 3) for p in proxies for org in "AB" for _ in range(5))
    )
    order = await skewed_flood(lab, sim, proxies, lambda: queued_is(sim_owner.url, 2 * PER_ORG - 1))
    assert Counter(order) == {"A": PER_ORG, "B": PER_ORG}
    assert out_of_bound(order, skip=1) == [], "".join(order)
    assert sim.stats.max_concurrent == 1  # one slot, whichever proxy dispatched
    assert await beside == ["ok 3"] * 20
    assert len(other.stats.log) == 20
    assert other.stats.max_concurrent <= 2

    # the shared calibration (its own key, its own slot) may be anywhere, but on its owner only
    where = {node.port: tags_on(node) - {"calibration"} for node in cluster.nodes}
    assert where == {sim_owner.port: {"sim"}, other_owner.port: {"other"}, entry.port: set()}
    calibration_owner = cluster.owner(CALIBRATION_KEY)
    assert not any("calibration" in tags_on(n) for n in cluster.nodes if n is not calibration_owner)
    for owner, pool in ((sim_owner, "sim"), (other_owner, "other")):
        with owner.client() as client:
            assert client.zcard(pool_prefix(pool) + "holders") == 2  # both proxies joined
    # dispatch.lua is the library "sfq": loaded where a pool lives, and only there
    assert (libraries(sim_owner), libraries(other_owner), libraries(entry)) == (
        {"sfq"}, {"sfq"}, set(),
    )  # fmt: skip
    seen = {node.port: calls(node) for node in cluster.nodes}
    for port, asked in seen.items():
        assert (asked["moved"], asked["ask"], asked["getkeys"]) == (0, 0, 0), (port, asked)
    assert seen[sim_owner.port]["fcall"] > 2 * PER_ORG  # a submit and a finish each, at least
    assert seen[other_owner.port]["fcall"] > 20
    assert seen[entry.port]["fcall"] == 0


async def test_an_orgs_rpm_holds_across_proxies_on_its_own_shard(
    lab: Lab, cluster: RedisClusterNodes
) -> None:
    """rpm 6 for org A, 4 requests through each of two proxies: 6 pass and 2 get 429, as on
    one Redis. A's buckets (admission.lua) are on the primary of ``sfq:{org:A}:``, another
    than the pool's: two shards serve each request, each with the library ``sfq`` loaded (one
    library, admission.lua and dispatch.lua), and no submit carries A's admission, which
    on one Redis it would."""
    sim_owner, _, entry = shards(cluster)
    org_owner = cluster.owner(ORG_A)
    assert org_owner is not sim_owner
    sim, other = await lab.backend(), await lab.backend(models=[OTHER_MODEL])
    config = two_pools(sim, other, entry, orgs={"A": {"rpm": 6}})
    proxies = [await lab.proxy(config) for _ in range(2)]

    outcomes = Counter([await ask(lab, p, "A") for p in proxies for _ in range(4)])
    assert outcomes == {"ok 2": 6, "429 rpm": 2}
    assert await ask(lab, proxies[1], "B") == "ok 2"  # B has no rpm: not limited by A's

    assert "org:A" in tags_on(org_owner)
    assert all("org:A" not in tags_on(node) for node in cluster.nodes if node is not org_owner)
    with org_owner.client() as client:
        bucket = client.hgetall(ORG_A + "bucket:r")
    assert (bucket["pm"], float(bucket["level"]) < 1) == ("6", True)  # emptied by the 6
    assert libraries(org_owner) == libraries(sim_owner) == {"sfq"}
    for node in cluster.nodes:
        asked = calls(node)
        assert (asked["moved"], asked["ask"], asked["getkeys"]) == (0, 0, 0), (node.port, asked)


async def test_a_shard_that_comes_back_empty_is_joined_again(
    lab: Lab, cluster: RedisClusterNodes
) -> None:
    """The primary of ``other`` loses its keys and its functions (a restart without
    persistence): the proxy loads the library there again and joins the pool anew, while
    ``sim``, on its own shard, serves throughout."""
    _, other_owner, entry = shards(cluster)
    sim, other = await lab.backend(), await lab.backend(models=[OTHER_MODEL])
    proxy = await lab.proxy(two_pools(sim, other, entry, ttl_s=TTL_S))
    assert [await ask(lab, proxy, "A", m) for m in (MODEL, OTHER_MODEL)] == ["ok 2"] * 2
    assert "sfq" in libraries(other_owner)

    with other_owner.client() as client:
        client.flushall()
        client.function_flush()
    assert libraries(other_owner) == set()
    assert await ask(lab, proxy, "B") == "ok 2"  # the other shard did not notice

    async def other_serves() -> bool:
        return await ask(lab, proxy, "A", OTHER_MODEL) == "ok 2"

    await eventually(other_serves, within=5 * TTL_S)
    assert "sfq" in libraries(other_owner)
    with other_owner.client() as client:
        assert client.zcard(pool_prefix("other") + "holders") == 1


async def test_a_burst_wider_than_a_nodes_connections_is_served(
    lab: Lab, cluster: RedisClusterNodes
) -> None:
    """200 requests at once on one pool, through one proxy: about as many Redis calls at
    once to one primary. redis-py's cluster client cannot wait for a free connection to a
    node (it raises at its bound), so the bound must be above what a process has in flight:
    at 64, most of these got 503."""
    _, _, entry = shards(cluster)
    sim = await lab.backend(max_num_seqs=256)
    other = await lab.backend(models=[OTHER_MODEL])
    proxy = await lab.proxy(two_pools(sim, other, entry))
    outcomes = Counter(await asyncio.gather(*(ask(lab, proxy, "AB"[i % 2]) for i in range(200))))
    assert outcomes == {"ok 2": 200}
