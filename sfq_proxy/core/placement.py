"""Which backend of a pool serves the next request (docs/design.md §5). No I/O, no clock.

Placement enforces each backend's concurrency slots and health; it never decides order,
which is the fair queue's job. Times are plain numbers the caller reads from its clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import BackendSpec


@dataclass(slots=True, eq=False)
class Backend:
    name: str
    url: str
    slots: int
    in_flight: int = 0
    healthy: bool = True  # trusted until a probe or a failed request says otherwise
    down_until: float = 0.0  # end of the cooldown after the last failure

    @property
    def load(self) -> float:
        return self.in_flight / self.slots


class Placement:
    """The backends of one pool and the rule for picking among them."""

    def __init__(self, specs: list[BackendSpec]) -> None:
        self.backends = [Backend(name=s.name or s.url, url=s.url, slots=s.slots) for s in specs]

    def update(self, specs: list[BackendSpec]) -> None:
        """A config reload: keep the backends still listed (their in-flight requests and
        health), take new ones only after their first good probe, and drop the others from
        placement; a dropped backend's requests finish and release their slots as usual."""
        current = {b.url: b for b in self.backends}
        backends = []
        for spec in specs:
            backend = current.get(spec.url)
            if backend is None:
                backend = Backend(name=spec.name or spec.url, url=spec.url, slots=spec.slots)
                backend.healthy = False  # joins after its first good probe
            backend.name, backend.slots = spec.name or spec.url, spec.slots
            backends.append(backend)
        self.backends = backends

    def choose(self) -> Backend | None:
        """The least loaded healthy backend with a free slot (first listed on ties)."""
        best = None
        for b in self.backends:
            if b.healthy and b.in_flight < b.slots and (best is None or b.load < best.load):
                best = b
        return best

    def acquire(self, backend: Backend) -> None:
        if backend.in_flight >= backend.slots:
            raise RuntimeError(f"backend {backend.name} has no free slot")
        backend.in_flight += 1

    def release(self, backend: Backend) -> None:
        if backend.in_flight <= 0:
            raise RuntimeError(f"backend {backend.name} released more slots than it had")
        backend.in_flight -= 1

    def mark_down(self, backend: Backend, until: float) -> None:
        """A failure: no new requests go to ``backend`` before ``until`` and a good probe."""
        backend.healthy = False
        backend.down_until = max(backend.down_until, until)

    def mark_up(self, backend: Backend, now: float) -> bool:
        """A good probe; True when it brought ``backend`` back (its cooldown is over)."""
        if backend.healthy or now < backend.down_until:
            return False
        backend.healthy = True
        return True

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)
