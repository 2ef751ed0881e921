"""Model patches scoped to the openvino backend (`backends=("openvino",)`); listed in the package's RULES."""

RULES: list = []
