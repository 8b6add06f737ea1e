"""A group of Ray actors, one per rank, called as one: the trainer's ranks and the rollout's shards alike.

:class:`ActorGroup` spawns rank i as a Ray actor of ``worker(*args[i])`` (on bundle i of a placement group
when given one: :func:`on_bundle`), and calls a method of every rank at once (:meth:`~ActorGroup.all`), of
rank 0 alone (:meth:`~ActorGroup.rank0`) or of every rank with arguments of its own
(:meth:`~ActorGroup.each`); results come in rank order. A rank's error is raised as soon as it comes,
named by its rank: its text reads ``rank 2: ...`` and it is still an instance of the error's own type
(:class:`RankError`), so that ``except NoProgressError`` catches a shard's as before.

What the verbs mean is the worker's: a group only fans calls out and gathers them. A member may also be
the worker object itself, in this process (tests run a group so), its methods awaited when they are
coroutines. ``ray`` is imported lazily.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


class RankError(Exception):
    """The error of one rank of a group: its text is ``rank <i>: <the error's text>``, the error itself is
    its ``__cause__``. :func:`rank_error` makes it an instance of the error's own type as well (with the
    error's attributes), so that an ``except`` of that type catches it as it caught the error."""

    rank: int
    _text: str

    def __str__(self) -> str:
        return self._text

    def __reduce__(self) -> tuple[Any, ...]:
        return rank_error, (self.rank, self.__cause__)


@functools.cache
def _named_type(kind: type[Exception]) -> type[RankError]:
    return type(f"RankError({kind.__name__})", (RankError, kind), {})


def rank_error(rank: int, err: Exception) -> Exception:
    """``err`` named by its ``rank`` (a :class:`RankError` of its type). Where its type cannot be
    subclassed, ``err`` itself, with a note naming the rank."""
    try:
        kind = _named_type(type(err))
        named = kind.__new__(kind, *err.args)  # what the type's own fields are read from
    except TypeError:  # a type that cannot be subclassed so, or built again from its args
        err.add_note(f"raised on rank {rank}")
        return err
    named.__dict__.update(err.__dict__)
    named.args, named.rank, named._text = err.args, rank, f"rank {rank}: {str(err) or type(err).__name__}"
    named.__cause__ = err
    return named


def _raise_named(rank: int, err: Exception) -> NoReturn:
    """Raise ``err`` named by its rank (in an ``except`` block of it)."""
    named = rank_error(rank, err)
    if named is err:
        raise err
    raise named from err


def on_bundle(group: PlacementGroup | None, index: int) -> Any:
    """The Ray scheduling strategy of bundle ``index`` of placement group ``group`` (None without a group)."""
    if group is None:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


async def _invoke(member: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``member.method(*args, **kwargs)``, awaited: through ``.remote()`` for a Ray actor, directly (and
    awaited when it returns an awaitable) for a worker in this process."""
    fn = getattr(member, method)
    if hasattr(fn, "remote"):
        return await fn.remote(*args, **kwargs)
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def _ranked(rank: int, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as err:
        _raise_named(rank, err)


class ActorGroup:
    """Ranks 0..N-1 of one worker class, called as one (see the module docstring). ``actors``: Ray actor
    handles (or workers in this process), in rank order; :meth:`spawn` starts them. Iterating the group
    gives the members."""

    def __init__(self, actors: Sequence[Any]) -> None:
        if not actors:
            raise ValueError("an ActorGroup needs at least one actor")
        self.actors = list(actors)

    @classmethod
    def spawn(
        cls,
        worker: type,
        args: Sequence[tuple[Any, ...]],
        *,
        placement_group: PlacementGroup | None = None,
        bundle_indices: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> ActorGroup:
        """``len(args)`` Ray actors, rank i built as ``worker(*args[i])`` with Ray's actor ``options``
        (``num_cpus``, ``num_gpus``, ``resources``, ``max_concurrency``...). ``placement_group``: rank i on
        its bundle ``bundle_indices[i]`` (default: bundle i); ``env``: environment variables every rank
        starts with (set before anything in it runs). Returns at once; a rank's construction error
        surfaces at its first call."""
        import ray

        n = len(args)
        if bundle_indices is not None and placement_group is None:
            raise ValueError("bundle_indices needs a placement_group")
        bundles = list(range(n)) if bundle_indices is None else list(bundle_indices)
        if len(bundles) != n:
            raise ValueError(f"bundle_indices names {len(bundles)} bundles for {n} ranks")
        actor_cls = ray.remote(worker)
        actors = []
        for rank, rank_args in enumerate(args):
            where: dict[str, Any] = {"runtime_env": {"env_vars": dict(env)}} if env else {}
            if placement_group is not None:
                where["scheduling_strategy"] = on_bundle(placement_group, bundles[rank])
            actors.append(actor_cls.options(**options, **where).remote(*rank_args))
        return cls(actors)

    def __len__(self) -> int:
        return len(self.actors)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actors)

    def __getitem__(self, rank: int) -> Any:
        return self.actors[rank]

    async def all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank at once; the results in rank order. The first error
        is raised as it comes (named by its rank), and the calls still running in this process are
        cancelled."""
        return await self.each(method, [args] * len(self), kwargs)

    async def rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on rank 0 alone (what it holds by itself); its error named."""
        return await _ranked(0, _invoke(self.actors[0], method, *args, **kwargs))

    async def each(
        self, method: str, args: Sequence[tuple[Any, ...]], kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Rank i's ``method(*args[i], **kwargs)``, all at once; the results in rank order; errors as
        :meth:`all`'s."""
        calls = [
            asyncio.ensure_future(_ranked(rank, _invoke(member, method, *a, **(kwargs or {}))))
            for rank, (member, a) in enumerate(zip(self.actors, args, strict=True))
        ]
        try:
            return list(await asyncio.gather(*calls))
        finally:
            for call in calls:
                call.cancel()

    async def all_settled(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`all`, but every rank's call runs to its end, each even when another fails; then the
        first error in rank order is raised (the other ranks' errors as its notes)."""
        calls = [_ranked(rank, _invoke(m, method, *args, **kwargs)) for rank, m in enumerate(self.actors)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also {other}")
            raise errors[0]
        return results

    def wait_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`all` of Ray actors, blocking (for a constructor, which cannot await)."""
        import ray

        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:  # the first error as it comes, as in all()
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except Exception as err:
                _raise_named(rank_of[ready[0]], err)
        return ray.get(refs)

    def wait_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`rank0` of a Ray actor, blocking."""
        import ray

        try:
            return ray.get(getattr(self.actors[0], method).remote(*args, **kwargs))
        except Exception as err:
            _raise_named(0, err)

    def kill(self) -> None:
        """Kill every rank's actor at once, whatever it is doing."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
