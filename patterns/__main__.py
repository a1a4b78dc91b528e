from . import table

print(table())
