"""OpenVINO backend fixes (stage `openvino`), in the order they run on the program before conversion."""

RULES: list = []
