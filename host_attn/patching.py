"""Record-and-restore monkeypatching with its own book of originals.

The hosts' own bookkeeping cannot be trusted for this: A1111's ``undo_optimizations()`` puts ldm's
AttnBlock forward on sgm's class, and Forge has none. A ``Patches`` object remembers what it replaced,
refuses to patch one attribute twice, and puts back exactly those objects.

Some hosts store their attention function on each block when the block is built
(``self.optimized_attention = …``), so a rebound module name reaches only blocks built afterwards.
``patch_stored`` reaches every block of a class, built before or after, through a data descriptor on
the class, which Python consults before an instance's own attributes; undo removes the descriptor,
and each block's own stored function shows again.
"""
from __future__ import annotations

_MISSING = object()


class DoublePatchError(RuntimeError):
    """The attribute is already patched by this record."""


class Patches:
    """One set of patches that is applied and undone together."""

    def __init__(self, name: str):
        self.name = name
        self._record: list[tuple[object, str, object, object]] = []

    @property
    def active(self) -> bool:
        return bool(self._record)

    def is_patched(self, owner, attr: str) -> bool:
        return any(o is owner and a == attr for o, a, _, _ in self._record)

    def intact(self) -> bool:
        """Whether every recorded attribute still holds the replacement set here (something else, such as
        A1111's ``undo_optimizations()``, may have reset it without going through ``undo()``)."""
        return all(_live(o, a) is new for o, a, _, new in self._record)

    def original(self, owner, attr: str):
        """What ``undo()`` will put back for ``owner.attr`` (the live value when it is not patched)."""
        for o, a, saved, _ in self._record:
            if o is owner and a == attr:
                return saved
        return getattr(owner, attr)

    def patch(self, owner, attr: str, replacement, restore_to=_MISSING) -> None:
        """Set ``owner.attr = replacement``; ``undo()`` restores the current value, or ``restore_to``.

        ``restore_to`` exists for targets whose current value is known to be wrong (sgm's AttnBlock after
        A1111's ``undo_optimizations()``). Raises DoublePatchError when this record already holds the attribute.
        """
        if self.is_patched(owner, attr):
            raise DoublePatchError(f"{self.name}: {_describe(owner, attr)} is already patched")
        saved = _live(owner, attr)
        if restore_to is not _MISSING:
            saved = restore_to
        self._record.append((owner, attr, saved, replacement))
        setattr(owner, attr, replacement)

    def patch_stored(self, cls, attr: str, replacement, when=None) -> None:
        """Make every instance of ``cls`` see ``replacement`` as ``attr`` (while ``when()`` is true, if
        given); what the host stores there is kept per instance, and is what instances see otherwise."""
        self.patch(cls, attr, Stored(attr, replacement, when))

    def undo(self) -> int:
        """Restore every recorded attribute, newest first; returns how many. Safe to call again."""
        count = 0
        while self._record:
            owner, attr, saved, _ = self._record.pop()
            if saved is _MISSING:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
            else:
                setattr(owner, attr, saved)
            count += 1
        return count

    def targets(self) -> list[str]:
        return [_describe(o, a) for o, a, _, _ in self._record]


class Stored:
    """A data descriptor standing in for a per-instance attribute (see ``Patches.patch_stored``)."""

    def __init__(self, attr: str, replacement, when=None):
        self.attr = attr
        self.replacement = replacement
        self.when = when

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if self.when is None or self.when():
            return self.replacement
        try:
            return obj.__dict__[self.attr]
        except KeyError:
            raise AttributeError(self.attr) from None

    def __set__(self, obj, value):
        obj.__dict__[self.attr] = value  # the host's own choice, for when the descriptor is gone

    def __delete__(self, obj):
        obj.__dict__.pop(self.attr, None)


def _live(owner, attr: str):
    """The attribute as stored on ``owner`` (a class's own ``__dict__`` entry, not an inherited one)."""
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


def _describe(owner, attr: str) -> str:
    name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__
    module = getattr(owner, "__module__", None)
    if isinstance(owner, type) and module:
        name = f"{module}.{name}"
    return f"{name}.{attr}"
