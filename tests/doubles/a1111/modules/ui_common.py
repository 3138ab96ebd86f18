"""Double of the part of modules/ui_common.py scripts meet: ``create_output_panel`` builds the output
HTML elements (``html_info_<tab>``, ``html_log_<tab>``, below the scripts' UI) and, as A1111's patched
component constructor does for each new component, runs ``scripts_current.after_component`` on them."""
from modules import scripts


class OutputPanel:
    infotext = None
    html_log = None


def create_output_panel(tabname, outdir=None, toprow=None):
    import gradio as gr

    res = OutputPanel()
    res.infotext = gr.HTML(elem_id=f"html_info_{tabname}", elem_classes="infotext")
    _after(res.infotext, elem_id=f"html_info_{tabname}")
    res.html_log = gr.HTML(elem_id=f"html_log_{tabname}", elem_classes="html-log")
    _after(res.html_log, elem_id=f"html_log_{tabname}")
    return res


def _after(component, **kwargs):
    if scripts.scripts_current is not None:
        scripts.scripts_current.after_component(component, **kwargs)
