"""Stage 3 (placeholder while stages 0-2 are tested)."""


def plan_units(module, key, config, keys):
    raise NotImplementedError("stage 3")


class Stage3:
    def __init__(self, runtime):
        raise NotImplementedError("stage 3")
