#!/usr/bin/env python3
"""The Python binding (examples/python/ubep_ctypes.py) against ubep/ubep_c.h and libubep.so.

Every function the header declares is declared by the binding with the same return type and
parameters (count, and the exact ctypes type of each scalar, and of what each pointer points
to: the binding's structures for the header's, c_void_p for an opaque handle or void), and
libubep.so exports it, at symbol version UBEP_0 (libubep.map), and nothing else; the binding
declares nothing else. A function added to the header, or a
parameter changed, without the binding following fails here, as it would fail at a Python
caller's run time (ctypes converts arguments by the declared types, unchecked).

Usage: c_abi_python_test.py UBEP_C_H LIBUBEP_SO EXAMPLES_PYTHON_DIR
"""
import ctypes
import re
import subprocess
import sys

SCALARS = {
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
}
# Pointed to only as handles (c_void_p): the library's opaque types, and void.
OPAQUE = {"ubep_rank", "ubep_dispatched", "void"}
# The header's structures: the binding's ctypes.Structure of each.
STRUCTS = {
    "ubep_model_shape": "ModelShape",
    "ubep_client_options": "ClientOptions",
    "ubep_rank_stats": "RankStats",
}


def declarations(header):
    """name -> (return type, [parameter types]) of every function ubep_c.h declares."""
    text = re.sub(r"/\*.*?\*/", "", open(header).read(), flags=re.S)
    found = {}
    for m in re.finditer(r"^([A-Za-z_][\w ]*?\**)\s*\b(ubep_\w+)\(([^)]*)\);", text, flags=re.M):
        ret, name, params = m.group(1).strip(), m.group(2), m.group(3)
        types = []
        if params.strip() != "void":
            for p in params.split(","):
                p = " ".join(p.split())
                # Drop the parameter's name: what follows the last '*' or space.
                types.append(re.sub(r"\s*\b\w+$", "", p) if not p.endswith("*") else p)
        found[name] = (ret, types)
    return found


def structures(header):
    """name -> [(field, C type)] of every `typedef struct { ... } name;` in ubep_c.h, in order."""
    text = re.sub(r"/\*.*?\*/", "", open(header).read(), flags=re.S)
    found = {}
    for m in re.finditer(r"typedef struct \{([^}]*)\}\s*(\w+);", text):
        fields = []
        for decl in m.group(1).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            f = re.match(r"^(.*?)\s*\b(\w+)$", decl)
            fields.append((f.group(2), f.group(1).replace(" *", "*")))
        found[m.group(2)] = fields
    return found


def matches(c_type, ctype, binding):
    """Whether the binding's ctypes type fits the header's C type, pointee for pointee."""
    c_type = c_type.replace("const ", "").replace(" ", "")
    if c_type == "void":
        return ctype is None
    if c_type == "char*":
        return ctype is ctypes.c_char_p
    if c_type.endswith("*"):
        pointee = c_type[:-1]
        if pointee in OPAQUE:
            return ctype is ctypes.c_void_p
        if not (isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer)):
            return False
        if pointee in STRUCTS:
            return ctype._type_ is getattr(binding, STRUCTS[pointee])
        return matches(pointee, ctype._type_, binding)
    return SCALARS.get(c_type) is ctype


def main(argv):
    header, so, examples = argv[1:4]
    sys.path.insert(0, examples)
    import ubep_ctypes  # noqa: E402

    declared = declarations(header)
    bound = ubep_ctypes.signatures()
    problems = []
    if len(declared) < 20:
        problems.append(f"only {len(declared)} functions parsed from {header}: the parser broke")
    for name in sorted(set(declared) - set(bound)):
        problems.append(f"{name}: declared in ubep_c.h, not in the binding")
    for name in sorted(set(bound) - set(declared)):
        problems.append(f"{name}: in the binding, not declared in ubep_c.h")
    lib = ctypes.CDLL(so)
    for name in sorted(set(declared) & set(bound)):
        ret, params = declared[name]
        restype, argtypes = bound[name]
        if not hasattr(lib, name):
            problems.append(f"{name}: not exported by {so}")
        if not matches(ret, restype, ubep_ctypes):
            problems.append(f"{name}: returns {ret}, the binding says {restype}")
        if len(params) != len(argtypes):
            problems.append(f"{name}: {len(params)} parameters, the binding {len(argtypes)}")
            continue
        for i, (c_type, ctype) in enumerate(zip(params, argtypes)):
            if not matches(c_type, ctype, ubep_ctypes):
                problems.append(f"{name}: parameter {i} is {c_type}, the binding says {ctype}")
    # What the library exports (its dynamic symbols defined in it): exactly the declared
    # functions, each at version UBEP_0.
    exported = {}
    for line in subprocess.run(["readelf", "--dyn-syms", "--wide", so], check=True,
                               capture_output=True, text=True).stdout.splitlines():
        fields = line.split()
        if len(fields) < 8 or not fields[0].rstrip(":").isdigit() or fields[6] in ("UND", "ABS"):
            continue
        symbol, _, version = fields[7].partition("@@")
        exported[symbol] = version
    if set(exported) != set(declared):
        problems.append(f"{so} exports {sorted(set(exported) - set(declared))} beyond ubep_c.h, "
                        f"lacks {sorted(set(declared) - set(exported))}")
    for name, version in sorted(exported.items()):
        if version != "UBEP_0":
            problems.append(f"{name}: exported at version '{version}', not UBEP_0")
    # The structures, field by field: the same names and types in the same order, hence the
    # same offsets and size (ctypes lays a Structure out as the C compiler does); a field
    # reordered or retyped in one and not the other would have ctypes write the wrong bytes.
    parsed = structures(header)
    if set(parsed) != set(STRUCTS):
        problems.append(f"structures in {header}: {sorted(parsed)}, expected {sorted(STRUCTS)}")
    for c_name, fields in sorted(parsed.items()):
        if c_name not in STRUCTS:
            continue
        binding_fields = getattr(ubep_ctypes, STRUCTS[c_name])._fields_
        if [f for f, _ in fields] != [f for f, _ in binding_fields]:
            problems.append(f"{c_name}: fields {[f for f, _ in fields]}, the binding's "
                            f"{[f for f, _ in binding_fields]}")
            continue
        for (field, c_type), (_, ctype) in zip(fields, binding_fields):
            if not matches(c_type, ctype, ubep_ctypes):
                problems.append(f"{c_name}.{field} is {c_type}, the binding says {ctype}")
        # No padding: struct_size tells versions apart only if every field added later
        # changes sizeof, which a field that fits in padding would not.
        structure = getattr(ubep_ctypes, STRUCTS[c_name])
        fields_size = sum(ctypes.sizeof(t) for _, t in binding_fields)
        if ctypes.sizeof(structure) != fields_size:
            problems.append(f"{c_name}: sizeof {ctypes.sizeof(structure)}, its fields "
                            f"{fields_size} bytes: padding a later field could fill")
    for p in problems:
        print(p)
    if not problems:
        print(f"{len(declared)} functions and {len(parsed)} structures: the binding matches "
              "ubep_c.h and libubep.so")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
