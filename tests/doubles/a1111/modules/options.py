"""Double of modules/options.py: OptionInfo, options_section and the Options store (host-contract A4)."""


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before='', comment_after='', infotext=None, restrict_api=False,
                 category_id=None):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.onchange = onchange
        self.section = section
        self.category_id = category_id
        self.refresh = refresh
        self.do_not_save = False
        self.comment_before = comment_before
        self.comment_after = comment_after
        self.infotext = infotext
        self.restrict_api = restrict_api
        self.reload_ui = False
        self.restart = False

    def link(self, label, url):
        self.comment_before += f"[<a href='{url}' target='_blank'>{label}</a>]"
        return self

    def js(self, label, js_func):
        self.comment_before += f"[<a onclick='{js_func}(); return false'>{label}</a>]"
        return self

    def info(self, info):
        self.comment_after += f"<span class='info'>({info})</span>"
        return self

    def html(self, html):
        self.comment_after += html
        return self

    def needs_restart(self):
        self.restart = True
        self.comment_after += " <span class='info'>(requires restart)</span>"
        return self

    def needs_reload_ui(self):
        self.reload_ui = True
        self.comment_after += " <span class='info'>(requires Reload UI)</span>"
        return self


def options_section(section_identifier, options_dict):
    """Stamp ``section`` (and ``category_id`` when given as a third item) on every entry; return the dict."""
    for v in options_dict.values():
        if len(section_identifier) == 2:
            v.section = section_identifier
        elif len(section_identifier) == 3:
            v.section = section_identifier[0:2]
            v.category_id = section_identifier[2]
    return options_dict


class Options:
    """Attribute access backed by ``data`` (saved values) and ``data_labels`` (OptionInfo per key)."""

    def __init__(self, data_labels=None, restricted_opts=None):
        self.data_labels = dict(data_labels or {})
        self.data = {k: v.default for k, v in self.data_labels.items()}
        self.restricted_opts = restricted_opts or set()

    def __setattr__(self, key, value):
        if key in ("data", "data_labels", "restricted_opts"):
            return super().__setattr__(key, value)
        if key in self.data or key in self.data_labels:
            self.data[key] = value
            return
        return super().__setattr__(key, value)

    def __getattr__(self, item):
        if item in ("data", "data_labels", "restricted_opts"):
            raise AttributeError(item)
        if item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        raise AttributeError(f"'Options' has no option {item!r}")

    def set(self, key, value, is_api=False, run_callbacks=True):
        """Set ``key``; run its onchange unless ``run_callbacks`` is False. A raising onchange restores the
        old value and returns False."""
        oldval = self.data.get(key, None)
        if oldval == value:
            return False
        option = self.data_labels.get(key)
        if option is not None and option.do_not_save:
            return False
        if is_api and option is not None and option.restrict_api:
            return False
        try:
            setattr(self, key, value)
        except RuntimeError:
            return False
        if run_callbacks and option is not None and option.onchange is not None:
            try:
                option.onchange()
            except Exception as e:
                from modules import errors
                errors.display(e, f"changing setting {key} to {value}")
                setattr(self, key, oldval)
                return False
        return True

    def cast_value(self, key, value):
        """``value`` (an infotext's text) as the type of the option's default."""
        if value is None:
            return None
        default_value = self.data_labels[key].default
        if default_value is None:
            default_value = getattr(self, key, None)
        if default_value is None:
            return None
        expected_type = type(default_value)
        if expected_type == bool and value == "False":
            return False
        return expected_type(value)

    def get_default(self, key):
        info = self.data_labels.get(key)
        return None if info is None else info.default

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data and not info.do_not_save:
            self.data[key] = info.default

    def onchange(self, key, func, call=True):
        item = self.data_labels.get(key)
        item.onchange = func
        if call:
            func()

    def reorder(self):
        order = {}
        for key, info in self.data_labels.items():
            order.setdefault(info.section, len(order))
        self.data_labels = dict(sorted(self.data_labels.items(), key=lambda kv: order[kv[1].section]))
