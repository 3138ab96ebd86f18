"""Double of modules/infotext_utils.py (A1111 1.10.1): how an infotext comes back into the UI.

What the webui does, in its order (read from its source):

* ``parse_generation_parameters(text)``: the last line holds the ``Key: value`` pairs when it has at least
  three of them (otherwise it is part of the prompt); a value in double quotes is JSON-unquoted; a value
  ``WxH`` becomes ``Key-1`` and ``Key-2``; a few of A1111's own keys get their defaults when missing; the
  keys of ``opts.infotext_skip_pasting`` are dropped.
* ``add_paste_fields(tabname, init_img, fields, override_settings_component)``: each tab's fields, each a
  ``PasteField(component, target)`` where ``target`` is an infotext key or a function of the parsed dict.
* ``connect_paste(button, paste_fields, input_comp, override_settings_component, tabname)``: the paste
  button (↙, PNG Info's "Send to …"): an empty prompt reads ``params.txt`` instead; the parsed dict goes to
  the ``infotext_pasted`` callbacks first; then each field gets ``target(params)`` (a function that
  raises gives nothing) or ``params[target]``: None leaves the field as it is, a ``gr.update`` is used as
  it is, another value is cast to the type of the component's current value.
* ``connect_paste_params_buttons()``: a "Send to <tab>" button under txt2img's images copies, component
  to component, the txt2img fields whose ``target`` is in ``['Prompt', 'Negative prompt', 'Steps',
  'Face restoration'] (+ 'Seed') + binding.paste_field_names`` (``target in list``: an infotext key, or
  the very function object) into the destination tab's fields matched the same way.
* ``get_override_settings(params)``: the settings whose ``OptionInfo.infotext`` key is in the infotext
  with a value other than the current one.
"""
from __future__ import annotations

import json
import os
import re

import gradio as gr

from modules import script_callbacks, shared

re_param_code = r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)'
re_param = re.compile(re_param_code)
re_imagesize = re.compile(r"^(\d+)x(\d+)$")
type_of_gr_update = type(gr.update())


class ParamBinding:
    def __init__(self, paste_button, tabname, source_text_component=None, source_image_component=None,
                 source_tabname=None, override_settings_component=None, paste_field_names=None):
        self.paste_button = paste_button
        self.tabname = tabname
        self.source_text_component = source_text_component
        self.source_image_component = source_image_component
        self.source_tabname = source_tabname
        self.override_settings_component = override_settings_component
        self.paste_field_names = paste_field_names or []


class PasteField(tuple):
    def __new__(cls, component, target, *, api=None):
        return super().__new__(cls, (component, target))

    def __init__(self, component, target, *, api=None):
        super().__init__()
        self.api = api
        self.component = component
        self.label = target if isinstance(target, str) else None
        self.function = target if callable(target) else None


paste_fields: dict[str, dict] = {}
registered_param_bindings: list[ParamBinding] = []


def reset():
    paste_fields.clear()
    registered_param_bindings.clear()


def quote(text):
    if ',' not in str(text) and '\n' not in str(text) and ':' not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text):
    if len(text) == 0 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except Exception:
        return text


def add_paste_fields(tabname, init_img, fields, override_settings_component=None):
    if fields:
        for i in range(len(fields)):
            if not isinstance(fields[i], PasteField):
                fields[i] = PasteField(*fields[i])
    paste_fields[tabname] = {"init_img": init_img, "fields": fields,
                             "override_settings_component": override_settings_component}


def register_paste_params_button(binding: ParamBinding):
    registered_param_bindings.append(binding)


def connect_paste_params_buttons():
    """The text parts of the bindings (images are not part of this double)."""
    for binding in registered_param_bindings:
        fields = paste_fields[binding.tabname]["fields"]
        override_settings_component = (binding.override_settings_component
                                       or paste_fields[binding.tabname]["override_settings_component"])
        if binding.source_text_component is not None and fields is not None:
            connect_paste(binding.paste_button, fields, binding.source_text_component, override_settings_component,
                          binding.tabname)
        if binding.source_tabname is not None and fields is not None:
            names = (['Prompt', 'Negative prompt', 'Steps', 'Face restoration']
                     + (["Seed"] if shared.opts.send_seed else []) + binding.paste_field_names)
            binding.paste_button.click(
                fn=lambda *x: x,
                inputs=[field for field, name in paste_fields[binding.source_tabname]["fields"] if name in names],
                outputs=[field for field, name in fields if name in names],
                show_progress=False,
            )


def parse_generation_parameters(x: str, skip_fields: list[str] | None = None):
    if skip_fields is None:
        skip_fields = shared.opts.infotext_skip_pasting
    res = {}
    prompt = ""
    negative_prompt = ""
    done_with_prompt = False
    *lines, lastline = x.strip().split("\n")
    if len(re_param.findall(lastline)) < 3:
        lines.append(lastline)
        lastline = ''
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done_with_prompt = True
            line = line[16:].strip()
        if done_with_prompt:
            negative_prompt += ("" if negative_prompt == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    for k, v in re_param.findall(lastline):
        try:
            if v[0] == '"' and v[-1] == '"':
                v = unquote(v)
            m = re_imagesize.match(v)
            if m is not None:
                res[f"{k}-1"] = m.group(1)
                res[f"{k}-2"] = m.group(2)
            else:
                res[k] = v
        except Exception:
            print(f"Error parsing \"{k}: {v}\"")
    res["Prompt"] = prompt
    res["Negative prompt"] = negative_prompt
    if "Clip skip" not in res:
        res["Clip skip"] = "1"
    if "Hires sampler" not in res:
        res["Hires sampler"] = "Use same sampler"
    if "Schedule type" not in res:
        res["Schedule type"] = "Automatic"
    for key in skip_fields:
        res.pop(key, None)
    return res


def get_override_settings(params, *, skip_fields=None):
    res = []
    mapping = [(info.infotext, k) for k, info in shared.opts.data_labels.items() if info.infotext]
    for param_name, setting_name in mapping:
        if param_name in (skip_fields or {}):
            continue
        v = params.get(param_name, None)
        if v is None:
            continue
        v = shared.opts.cast_value(setting_name, v)
        current_value = getattr(shared.opts, setting_name, None)
        if v == current_value:
            continue
        res.append((param_name, setting_name, v))
    return res


def connect_paste(button, paste_fields, input_comp, override_settings_component, tabname):
    def paste_func(prompt):
        if not prompt and not shared.cmd_opts.hide_ui_dir_config and not shared.cmd_opts.no_prompt_history:
            from modules import paths_internal
            filename = os.path.join(paths_internal.data_path, "params.txt")
            try:
                with open(filename, "r", encoding="utf8") as file:
                    prompt = file.read()
            except OSError:
                pass
        params = parse_generation_parameters(prompt)
        script_callbacks.infotext_pasted_callback(prompt, params)
        res = []
        for output, key in paste_fields:
            if callable(key):
                try:
                    v = key(params)
                except Exception:
                    from modules import errors
                    errors.report(f"Error executing {key}", exc_info=True)
                    v = None
            else:
                v = params.get(key, None)
            if v is None:
                res.append(gr.update())
            elif isinstance(v, type_of_gr_update):
                res.append(v)
            else:
                try:
                    valtype = type(output.value)
                    if valtype == bool and v == "False":
                        val = False
                    elif valtype == int:
                        val = float(v)
                    else:
                        val = valtype(v)
                    res.append(gr.update(value=val))
                except Exception:
                    res.append(gr.update())
        return res

    if override_settings_component is not None:
        already_handled_fields = {key: 1 for _, key in paste_fields}

        def paste_settings(params):
            vals = get_override_settings(params, skip_fields=already_handled_fields)
            vals_pairs = [f"{infotext_text}: {value}" for infotext_text, setting_name, value in vals]
            return gr.Dropdown.update(value=vals_pairs, choices=vals_pairs, visible=bool(vals_pairs))

        paste_fields = paste_fields + [(override_settings_component, paste_settings)]

    button.click(fn=paste_func, inputs=[input_comp], outputs=[x[0] for x in paste_fields], show_progress=False)
