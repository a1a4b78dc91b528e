from . import support_matrix

print(support_matrix())
