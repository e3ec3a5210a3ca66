"""The launch rule: the settings a chunk kernel role runs with, from the launch tables and the
facts of one call.

One rule for everyone who asks. Every generated module carries this code (copied into it) and
calls it from its `_launch`; lrdsl's chunk-size estimate (codegen/launch.py, `launch_for`) calls
this same function on the same tables, so the estimate rates the launches the module runs. The
tables are plain dicts here ({"BV", "num_warps", "num_stages"[, "maxnreg"]} per role), rendered
from the typed ones of codegen/launch.py.
"""
from .helpers import _next_power_of_2
# tl.dot on NVIDIA GPUs needs every dimension >= 16 (the interpreter takes any): key and value
# tiles are at least this wide, their columns past K or V masked to 0.
SMALLEST_DOT_TILE = 16


def resolve_launch(tables, role, *, precision, wide_k, wide_inputs, small_chunk, grouped, V,
                   scan_programs=None, multiprocessors=0, replaced=None):
    """The launch settings of kernel `role`: its base setting (tables["launch"]) overlaid by the
    partial settings of the tables that apply, in this order:
      - fp32 matmul operands (precision "tf32"): tables["launch_fp32"]; else
      - K above the module's WIDE_K (wide_k): tables["launch_wide"]; else
      - fp32 or fp64 inputs, which multiply in their own width (wide_inputs):
        tables["launch_wide_inputs"]; else, on the tiles the tables below were checked at:
          - below the largest chunk size (small_chunk): tables["launch_small_chunk"], then with
            grouped value heads (grouped, HV > H) tables["launch_grouped_small_chunk"];
          - a scan with fewer programs (scan_programs(BV); None: a scan run in segments, whose
            programs are many) than the GPU's multiprocessors: tables["launch_few_programs"],
            then with fewer than half of them tables["launch_fewer_programs"];
      - a caller's own settings for the role (replaced: lrdsl resources --launch).
    The value columns are then clamped to at least SMALLEST_DOT_TILE and at most V rounded up
    to a power of two."""
    settings = dict(tables["launch"][role])
    if precision == "tf32":
        settings.update(tables["launch_fp32"].get(role, {}))
    elif wide_k:
        settings.update(tables["launch_wide"].get(role, {}))
    elif wide_inputs:
        settings.update(tables["launch_wide_inputs"].get(role, {}))
    else:  # the default tiles: the settings below were checked to fit there
        if small_chunk:
            settings.update(tables["launch_small_chunk"].get(role, {}))
            if grouped:
                settings.update(tables["launch_grouped_small_chunk"].get(role, {}))
        # a scan with few programs: its own settings, whatever the chunk size
        few = tables["launch_few_programs"]
        if role in few and scan_programs is not None and scan_programs(settings["BV"]) < multiprocessors:
            settings.update(few[role])
            if scan_programs(settings["BV"]) < multiprocessors // 2:
                settings.update(tables["launch_fewer_programs"][role])
    settings.update(replaced or {})
    settings["BV"] = max(SMALLEST_DOT_TILE, min(_next_power_of_2(V), settings["BV"]))
    return settings
