"""Double of modules/errors.py: report to stderr, never raise."""
import sys
import traceback

_shown = set()


def report(message, *, exc_info=False):
    print(f"*** {message}", file=sys.stderr)
    if exc_info:
        traceback.print_exc()


def display(e, task, *, full_traceback=False):
    print(f"{task or 'error'}: {type(e).__name__}", file=sys.stderr)
    print(traceback.format_exc(), file=sys.stderr)


def display_once(e, task):
    if task in _shown:
        return
    display(e, task)
    _shown.add(task)
