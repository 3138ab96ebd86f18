"""Record-and-restore monkeypatching with its own book of originals.

The hosts' own bookkeeping cannot be trusted for this: A1111's ``undo_optimizations()`` puts ldm's
AttnBlock forward on sgm's class, and Forge has none. A ``Patches`` object remembers what it replaced,
refuses to patch one attribute twice, and puts back exactly those objects.

Some hosts store their attention function on each block when the block is built
(``self.optimized_attention = …``), so a rebound module name reaches only blocks built afterwards.
``patch_stored`` reaches every block of a class, built before or after, through a data descriptor on
the class, which Python consults before an instance's own attributes; undo removes the descriptor,
and each block's own stored function shows again.

Another extension may wrap a name after this one did. ``undo`` then leaves that wrapper in place and
takes only this project's out from under it: where the wrapper reaches ours through a closure, a module
global or another attribute of the same owner, that reference is pointed at the original. Where ours
cannot be reached, it stays under theirs as a pass-through: a ``Stored`` descriptor shows the host's own
value again, and a function is marked with the original (``passthrough``) for the functions that read it.
Either way the log says so. Records are changed under one lock, so threads undoing at once each see a
record once.
"""
from __future__ import annotations

import functools
import sys
import threading

from . import voice

_MISSING = object()
#: Every record and every chain walk goes under this lock (shared: a walk reads other records' names).
_lock = threading.RLock()
#: (id(owner), attr) of every name some record holds now: references the walk must not rewrite.
_held: dict = {}
#: How deep the walk follows another wrapper's chain of wrapped functions.
DEPTH = 8


class DoublePatchError(RuntimeError):
    """The attribute is already patched by this record."""


class Patches:
    """One set of patches that is applied and undone together."""

    def __init__(self, name: str):
        self.name = name
        self._record: list[tuple[object, str, object, object]] = []
        #: (id(owner), attr) -> the values the host itself puts there when it resets the target (``reset_to``)
        self._resets: dict = {}

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

    def patch(self, owner, attr: str, replacement, restore_to=_MISSING, reset_to=_MISSING) -> None:
        """Set ``owner.attr = replacement``; ``undo()`` restores the current value, or ``restore_to``.

        ``restore_to`` exists for targets whose current value is known to be wrong (sgm's AttnBlock after
        A1111's ``undo_optimizations()``). ``reset_to``: a value the host itself puts there when it resets the
        target without going through ``undo()`` (that same ldm forward on sgm's AttnBlock); found there by
        ``undo()``, it is the host's reset, not another extension's wrapper, and the saved value goes back (as
        for the wrong value ``restore_to`` replaced). Raises DoublePatchError when this record already holds
        the attribute.
        """
        with _lock:
            if self.is_patched(owner, attr):
                raise DoublePatchError(f"{self.name}: {_describe(owner, attr)} is already patched")
            saved = _live(owner, attr)
            resets = () if reset_to is _MISSING else (reset_to,)
            if restore_to is not _MISSING:
                resets, saved = (*resets, saved), restore_to
            if resets:
                self._resets[(id(owner), attr)] = resets
            _retire(replacement, None, retired=False)  # in force again (one left as a pass-through before)
            self._record.append((owner, attr, saved, replacement))
            _held[(id(owner), attr)] = _held.get((id(owner), attr), 0) + 1
            setattr(owner, attr, replacement)

    def patch_stored(self, cls, attr: str, replacement, when=None) -> None:
        """Make every instance of ``cls`` see ``replacement`` as ``attr`` (while ``when()`` is true, if
        given); what the host stores there is kept per instance, and is what instances see otherwise."""
        self.patch(cls, attr, Stored(attr, replacement, when))

    def undo(self) -> int:
        """Restore every recorded attribute that still holds this record's replacement, newest first; one
        that another wrapper was put on after keeps that wrapper, with this record's taken out from under
        it (see the module's doc). Returns how many were put back or taken out. Safe to call again, and
        from several threads at once."""
        count = 0
        with _lock:
            while self._record:
                owner, attr, saved, replacement = self._record.pop()
                key = (id(owner), attr)
                _held[key] -= 1
                if not _held[key]:
                    del _held[key]
                live = _live(owner, attr)
                if live is replacement or any(live is value for value in self._resets.pop(key, ())):
                    _restore(owner, attr, saved)
                    if getattr(replacement, "__attn_reads_passthrough__", False):
                        # copies of it bound by name elsewhere while it was in force, which no record
                        # puts back, reach the original from now on
                        _retire(replacement, _original_value(owner, attr, saved))
                elif live is not saved and live is not _MISSING:
                    self._leave_under(owner, attr, live, saved, replacement)
                # else: already put back (A1111's undo_optimizations()) or deleted: nothing to do
                count += 1
        return count

    def _leave_under(self, owner, attr: str, live, saved, replacement) -> None:
        """``owner.attr`` holds another wrapper put on after ``replacement``: that one stays working."""
        where = _describe(owner, attr)
        theirs = _name_of(live)
        original = _original_value(owner, attr, saved)
        if _unwrap(owner, live, replacement, original):
            voice.log(f"{self.name}: {where} was wrapped again after this extension ({theirs}); that wrapper "
                      f"stays, and now calls the original instead of this extension's")
            return
        _retire(replacement, original)
        what = ("left under it, passing every call to the original" if _passes(replacement, original) else
                "left under it, and calls that reach it still run on this extension")
        voice.log(f"{self.name}: {where} was wrapped again after this extension ({theirs}); that wrapper stays, "
                  f"this extension's is {what}")

    def targets(self) -> list[str]:
        return [_describe(o, a) for o, a, _, _ in self._record]


class Stored:
    """A data descriptor standing in for a per-instance attribute (see ``Patches.patch_stored``)."""

    def __init__(self, attr: str, replacement, when=None):
        self.attr = attr
        self.replacement = replacement
        self.when = when
        self.retired = False  # set once undone while another descriptor sits on top of this one

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if not self.retired and (self.when is None or self.when()):
            return self.replacement
        try:
            return obj.__dict__[self.attr]
        except KeyError:
            raise AttributeError(self.attr) from None

    def __set__(self, obj, value):
        obj.__dict__[self.attr] = value  # the host's own choice, for when the descriptor is gone

    def __delete__(self, obj):
        obj.__dict__.pop(self.attr, None)


def passthrough(function):
    """The original to call instead, once ``undo`` left ``function`` under another extension's wrapper that
    it could not take it out of; None while ``function`` is in force. For replacements that check it."""
    return getattr(function, "__attn_passthrough__", None)


def _retire(replacement, original, retired: bool = True) -> None:
    """Mark ``replacement`` as left under another wrapper (calls to go to ``original``), or in force again."""
    if isinstance(replacement, Stored):
        replacement.retired = retired
        return
    try:
        if retired and original is not None:
            replacement.__attn_passthrough__ = original
        else:
            vars(replacement).pop("__attn_passthrough__", None)
    except (AttributeError, TypeError):  # a module, a builtin: nothing to mark
        pass


def _passes(replacement, original) -> bool:
    """Whether ``replacement``, retired, passes calls on (``Stored`` shows the host's value; a function does
    when it says so with ``reads_passthrough`` and the original is known)."""
    if isinstance(replacement, Stored):
        return True
    return original is not None and getattr(replacement, "__attn_reads_passthrough__", False)


def reads_passthrough(function):
    """Declare that ``function`` calls ``passthrough(function)`` instead of its own work once that is set:
    ``undo`` sets it whenever it takes ``function`` away (put back or left under another wrapper), so that
    copies of it made by name while it was in force pass their calls on."""
    function.__attn_reads_passthrough__ = True
    return function


def _restore(owner, attr: str, saved) -> None:
    if saved is _MISSING:
        try:
            delattr(owner, attr)
        except AttributeError:
            pass
    else:
        setattr(owner, attr, saved)


def _original_value(owner, attr: str, saved):
    """What a wrapper that called the replacement should call instead: the saved value, or, where nothing
    was stored on ``owner`` itself, what ``owner.attr`` finds without it (an inherited method)."""
    if saved is not _MISSING:
        return saved
    if isinstance(owner, type):
        for base in owner.__mro__[1:]:
            if attr in vars(base):
                return vars(base)[attr]
    return None


def _unwrap(owner, top, ours, original) -> bool:
    """Point every reference to ``ours`` in the chain of wrappers under ``top`` at ``original``: closure
    cells, module globals the wrappers' code reads, the owner's other attributes; True when one was found."""
    if original is None:
        return False
    found = False
    seen, frontier = set(), [(top, 0)]
    while frontier:
        obj, depth = frontier.pop()
        if id(obj) in seen or depth > DEPTH:
            continue
        seen.add(id(obj))
        function = _function_of(obj)
        if function is None:
            continue
        for cell in function.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
            if held is ours:
                cell.cell_contents = original
                found = True
            elif callable(held) or isinstance(held, (staticmethod, classmethod)):
                frontier.append((held, depth + 1))
        namespace = function.__globals__
        for name in function.__code__.co_names:
            if namespace.get(name) is ours and (id(_module_of(namespace)), name) not in _held:
                namespace[name] = original
                found = True
        below = getattr(obj, "__wrapped__", None)
        if below is ours:
            try:
                obj.__wrapped__ = original
            except (AttributeError, TypeError):
                pass
        elif below is not None:
            frontier.append((below, depth + 1))
    space = vars(owner) if isinstance(owner, type) else getattr(owner, "__dict__", {})
    for name, value in list(space.items()):
        if value is ours and (id(owner), name) not in _held:
            setattr(owner, name, original)  # ``CrossAttention.orig_forward = CrossAttention.forward``
            found = True
    return found


def _function_of(obj):
    """The plain function behind ``obj`` (a method, a static or class method, a partial), or None."""
    for _ in range(4):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, (staticmethod, classmethod)) or hasattr(obj, "__func__"):
            obj = obj.__func__
        else:
            break
    return obj if hasattr(obj, "__code__") and hasattr(obj, "__globals__") else None


def _module_of(namespace: dict):
    module = sys.modules.get(namespace.get("__name__", ""))
    return module if module is not None and vars(module) is namespace else namespace


def _name_of(value) -> str:
    function = _function_of(value)
    if function is not None:  # from its code: a wrapper made with functools.wraps carries the wrapped one's name
        code = function.__code__
        return f"{function.__globals__.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
    return type(value).__qualname__


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
