"""The rules: one package per stage, one module per rule.

Rule `<stage>/<name>` lives in `rules/<stage>/<name>.py` as `<name>`, dashes written as underscores. Modules
whose name starts with `_` hold code that several rules share.
"""
