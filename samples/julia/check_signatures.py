#!/usr/bin/python3
"""Check a Julia binding of sfsync against include/sfsync.h, without Julia.

Every `ccall((:sf_name, LIB), RetType, (ArgTypes...), args...)` in the Julia
file must name a function the header declares with SF_API, with a return type
and argument types that correspond to the C declaration, and as many actual
arguments as argument types. Every Julia struct that mirrors a header struct
(sf_options -> SfOptions, sf_stats -> SfStats) must be an immutable `struct`
with the same fields, in the same order, of corresponding types; a header
struct a called function takes must have such a mirror.

C type            Julia types accepted
int32_t, enums    Int32, Cint         (sf_status, sf_dtype, ... are int32_t)
int64_t           Int64, Clonglong
uint64_t          UInt64, Culonglong
double            Cdouble, Float64
void (return)     Cvoid, Nothing
const char*       Cstring, Ptr{UInt8}, Ptr{Cchar}
T*                Ptr{J} or Ref{J} (Ref not as a return type), J the type for T;
                  void* and opaque structs (sf_context*) take Cvoid
char x[N]         NTuple{N,UInt8} or NTuple{N,Cchar}  (struct fields)

Usage:
  check_signatures.py [--header include/sfsync.h] [--julia sfsync_trainer.jl] [-v]
  check_signatures.py --self-test    # the checker must reject known-bad bindings

Exit status: 0 everything corresponds, 1 a mismatch (each one printed), 2 a
file that cannot be read or parsed.
Standard library only; runs with /usr/bin/python3 (3.8 or newer).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_HEADER = os.path.normpath(os.path.join(HERE, "..", "..", "include", "sfsync.h"))
DEFAULT_JULIA = os.path.join(HERE, "sfsync_trainer.jl")

SCALARS = {  # C scalar -> Julia names, the preferred one first
    "int32_t": ["Int32", "Cint"],
    "int64_t": ["Int64", "Clonglong"],
    "uint64_t": ["UInt64", "Culonglong"],
    "uint32_t": ["UInt32", "Cuint"],
    "int": ["Cint", "Int32"],
    "double": ["Cdouble", "Float64"],
    "float": ["Cfloat", "Float32"],
    "size_t": ["Csize_t", "UInt64"],
    "char": ["UInt8", "Cchar", "Int8"],
    "uint8_t": ["UInt8"],
}
VOID = {"Cvoid", "Nothing"}
CSTRING = {"Cstring", "Ptr{UInt8}", "Ptr{Cchar}", "Ptr{Int8}"}


class ParseError(Exception):
    pass


# ---- The C header ----------------------------------------------------------

@dataclass
class CType:
    base: str      # resolved through scalar typedefs: "int32_t", "sf_options", "void", ...
    pointers: int  # number of '*'
    const: bool    # a `const` anywhere in the declaration
    spelled: str   # as written, for messages

    def __str__(self):
        return self.spelled


@dataclass
class CField:
    name: str
    ctype: CType
    array: Optional[int] = None  # element count for `T name[N]`


@dataclass
class Header:
    functions: Dict[str, Tuple[CType, List[CType]]] = field(default_factory=dict)
    structs: Dict[str, List[CField]] = field(default_factory=dict)  # with fields
    opaque: set = field(default_factory=set)                          # declared, no fields
    aliases: Dict[str, str] = field(default_factory=dict)
    defines: Dict[str, int] = field(default_factory=dict)


def strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse_c_type(spelled: str, aliases: Dict[str, str]) -> CType:
    tokens = re.findall(r"[A-Za-z_]\w*|\*", spelled)
    const = "const" in tokens
    words = [t for t in tokens if t not in ("const", "*", "struct")]
    if not words:
        raise ParseError("cannot read the C type '%s'" % spelled.strip())
    base = " ".join(words)
    seen = set()
    while base in aliases and base not in seen:
        seen.add(base)
        base = aliases[base]
    return CType(base, tokens.count("*"), const, " ".join(spelled.split()))


def split_c_declarator(decl: str) -> Tuple[str, str]:
    """'const sf_options* opts' -> ('const sf_options*', 'opts')."""
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*$", decl.strip(), flags=re.S)
    if not m or not re.search(r"[A-Za-z_]\w*|\*", m.group(1)):
        raise ParseError("cannot split '%s' into a type and a name" % decl.strip())
    return m.group(1), m.group(2)


def parse_header(text: str) -> Header:
    h = Header()
    for name, value in re.findall(r"^\s*#\s*define\s+(\w+)\s+\(?(-?\d+)\)?\s*$", text, flags=re.M):
        h.defines[name] = int(value)
    code = strip_c_comments(text)
    for target, alias in re.findall(r"\btypedef\s+((?:unsigned\s+|signed\s+)?\w+)\s+(\w+)\s*;", code):
        if target not in ("struct", "enum", "union"):
            h.aliases[alias] = target
    for tag, alias in re.findall(r"\btypedef\s+struct\s+(\w+)\s+(\w+)\s*;", code):
        h.opaque.add(alias)
    for tag, body, alias in re.findall(r"\btypedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", code, flags=re.S):
        fields = []
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            array = None
            m = re.match(r"^(.*?)\[\s*(\w+)\s*\]$", decl, flags=re.S)
            if m:
                decl, size = m.group(1), m.group(2)
                if size.isdigit():
                    array = int(size)
                elif size in h.defines:
                    array = h.defines[size]
                else:
                    raise ParseError("struct %s: array size '%s' is not a number or #define" % (alias, size))
            fp = re.match(r"^.*?\(\s*\*\s*([A-Za-z_]\w*)\s*\)\s*\(.*\)$", decl, flags=re.S)
            if fp:  # a function pointer (sf_store's callbacks): Ptr{Cvoid} in Julia
                fields.append(CField(fp.group(1), parse_c_type("void*", h.aliases), array))
                continue
            ctype_text, name = split_c_declarator(decl)
            fields.append(CField(name, parse_c_type(ctype_text, h.aliases), array))
        h.structs[alias] = fields
        h.opaque.discard(alias)
    for ret, name, params in re.findall(r"\bSF_API\s+([^;(){}]*?)\b(sf_\w+)\s*\(([^)]*)\)\s*;", code, flags=re.S):
        params = params.strip()
        args = []
        if params and params != "void":
            for p in params.split(","):
                ctype_text, _ = split_c_declarator(p)
                args.append(parse_c_type(ctype_text, h.aliases))
        h.functions[name] = (parse_c_type(ret, h.aliases), args)
    if not h.functions:
        raise ParseError("no SF_API function declaration found")
    return h


# ---- The Julia file --------------------------------------------------------

@dataclass
class JCall:
    function: str
    ret: str
    args: List[str]
    nactual: int
    line: int


@dataclass
class JStruct:
    name: str
    mutable: bool
    fields: List[Tuple[str, str]]
    line: int


@dataclass
class Julia:
    calls: List[JCall] = field(default_factory=list)
    structs: Dict[str, JStruct] = field(default_factory=dict)
    consts: Dict[str, int] = field(default_factory=dict)


def strip_julia_comments(text: str) -> str:
    """Blank out # and #= =# comments (keeping line breaks), leaving strings alone."""
    out = []
    i, n = 0, len(text)
    depth = 0           # #= =# nesting
    quote = None        # '"', '"""' or "'" while inside a literal
    while i < n:
        c = text[i]
        if depth:
            if text.startswith("=#", i):
                depth -= 1
                out.append("  ")
                i += 2
            elif text.startswith("#=", i):
                depth += 1
                out.append("  ")
                i += 2
            else:
                out.append("\n" if c == "\n" else " ")
                i += 1
        elif quote:
            if c == "\\" and quote != "'":
                out.append(text[i:i + 2])
                i += 2
            elif text.startswith(quote, i):
                out.append(quote)
                i += len(quote)
                quote = None
            else:
                out.append(c)
                i += 1
        elif text.startswith("#=", i):
            depth = 1
            out.append("  ")
            i += 2
        elif c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith('"""', i):
            quote = '"""'
            out.append(quote)
            i += 3
        elif c == '"':
            quote = '"'
            out.append(c)
            i += 1
        elif c == "'" and i + 2 < n and (text[i + 2] == "'" or text[i + 1] == "\\"):
            # a Char literal such as 'a' or '\n' (not the adjoint operator)
            j = text.find("'", i + 2 if text[i + 1] == "\\" else i + 1)
            j = i + 2 if j < 0 else j
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def split_top_level(s: str) -> List[str]:
    """Split on commas outside (), {}, [] and string literals."""
    parts, depth, cur, quote = [], 0, [], False
    for c in s:
        if c == '"':
            quote = not quote
        if not quote:
            if c in "({[":
                depth += 1
            elif c in ")}]":
                depth -= 1
            elif c == "," and depth == 0:
                parts.append("".join(cur).strip())
                cur = []
                continue
        cur.append(c)
    parts.append("".join(cur).strip())
    return parts


def matching_paren(s: str, open_at: int) -> int:
    depth, quote = 0, False
    for i in range(open_at, len(s)):
        c = s[i]
        if c == '"':
            quote = not quote
        elif not quote and c == "(":
            depth += 1
        elif not quote and c == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ParseError("unbalanced parentheses after offset %d" % open_at)


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def parse_julia(text: str) -> Julia:
    code = strip_julia_comments(text)
    j = Julia()
    line_of = lambda offset: code.count("\n", 0, offset) + 1
    for name, value in re.findall(r"^\s*const\s+(\w+)\s*=\s*(\d+)\s*$", code, flags=re.M):
        j.consts[name] = int(value)
    for m in re.finditer(r"^\s*(mutable\s+)?struct\s+(\w+)[^\n]*\n(.*?)^\s*end\b", code, flags=re.M | re.S):
        fields = []
        for ln in m.group(3).splitlines():
            ln = ln.strip()
            if not ln:
                continue
            fm = re.match(r"^(\w+)\s*::\s*(.+)$", ln)
            if not fm:
                fields = None  # a struct with constructors or untyped fields: not a C mirror
                break
            fields.append((fm.group(1), squash(fm.group(2))))
        if fields is not None:
            j.structs[m.group(2)] = JStruct(m.group(2), bool(m.group(1)), fields, line_of(m.start(2)))
    for m in re.finditer(r"\bccall\s*\(", code):
        close = matching_paren(code, m.end() - 1)
        parts = split_top_level(code[m.end():close])
        target = parts[0] if parts else ""
        tm = re.match(r"^\(\s*:(\w+)\s*,", target)
        if not tm:
            continue  # ccall(:memset, ...) or a function pointer: not an sfsync call
        if not tm.group(1).startswith("sf_"):
            continue
        line = line_of(m.start())
        if len(parts) < 3:
            raise ParseError("line %d: ccall of %s lacks a return type or argument tuple" % (line, tm.group(1)))
        tup = parts[2].strip()
        if not (tup.startswith("(") and tup.endswith(")")):
            raise ParseError("line %d: ccall of %s: the argument types '%s' are not a tuple literal"
                             % (line, tm.group(1), tup))
        inner = tup[1:-1].strip()
        argtypes = [squash(a) for a in split_top_level(inner) if a.strip()] if inner else []
        j.calls.append(JCall(tm.group(1), squash(parts[1]), argtypes, len(parts) - 3, line))
    return j


# ---- Correspondence --------------------------------------------------------

def camel(c_name: str) -> str:
    """sf_options -> SfOptions: the name a Julia mirror of a header struct has."""
    return "".join(w[:1].upper() + w[1:] for w in c_name.split("_"))


def strip_wrapper(jtype: str, wrappers) -> Optional[str]:
    for w in wrappers:
        if jtype.startswith(w + "{") and jtype.endswith("}"):
            return jtype[len(w) + 1:-1]
    return None


def canonical(ctype: CType, h: Header) -> str:
    """The preferred Julia spelling of a C type below the top level."""
    if ctype.pointers:
        return "Ptr{%s}" % canonical(CType(ctype.base, ctype.pointers - 1, False, ""), h)
    if ctype.base == "void" or ctype.base in h.opaque:
        return "Cvoid"
    if ctype.base in SCALARS:
        return SCALARS[ctype.base][0]
    return camel(ctype.base)


def accepted(ctype: CType, h: Header) -> str:
    """What the Julia side of a ccall should be, for messages."""
    if ctype.pointers == 0:
        if ctype.base in SCALARS:
            return " or ".join(SCALARS[ctype.base])
        return canonical(ctype, h)
    if ctype.base == "char" and ctype.pointers == 1:
        return "Cstring or Ptr{UInt8}"
    pointee = canonical(CType(ctype.base, ctype.pointers - 1, False, ""), h)
    return "Ptr{%s} or Ref{%s}" % (pointee, pointee)


def corresponds(ctype: CType, jtype: str, h: Header, is_return: bool = False, top: bool = True) -> bool:
    if ctype.pointers == 0:
        if ctype.base == "void":
            return jtype in VOID
        if ctype.base in SCALARS:
            return jtype in SCALARS[ctype.base]
        if ctype.base in h.opaque:
            return not top and (jtype in VOID or jtype == camel(ctype.base))
        if ctype.base in h.structs:
            return jtype == camel(ctype.base)
        return False
    if top and ctype.base == "char" and ctype.pointers == 1 and jtype in CSTRING:
        return True
    inner = strip_wrapper(jtype, ("Ptr",) if (is_return or not top) else ("Ptr", "Ref"))
    if inner is None:
        return False
    pointee = CType(ctype.base, ctype.pointers - 1, ctype.const, ctype.spelled)
    if pointee.pointers == 0 and pointee.base == "void":
        return inner in VOID
    return corresponds(pointee, inner, h, is_return, top=False)


def check_struct(c_name: str, cfields: List[CField], js: JStruct, h: Header, j: Julia) -> List[str]:
    errors = []
    where = "struct %s (line %d) mirroring %s" % (js.name, js.line, c_name)
    if js.mutable:
        errors.append("%s: must be an immutable `struct` (a mutable one has no C layout)" % where)
    if len(js.fields) != len(cfields):
        errors.append("%s: %d fields, the header has %d (%s)"
                      % (where, len(js.fields), len(cfields), ", ".join(f.name for f in cfields)))
    for i, (cf, (jname, jtype)) in enumerate(zip(cfields, js.fields)):
        problem = None
        if jname != cf.name:
            problem = "is named %s, the header's field %d is %s" % (jname, i + 1, cf.name)
        elif cf.array is not None:
            m = re.match(r"^NTuple\{(\w+),(\w+)\}$", jtype)
            if not m:
                problem = "is %s, expected NTuple{%d,%s}" % (jtype, cf.array, canonical(cf.ctype, h))
            else:
                literal = m.group(1).isdigit()
                size = int(m.group(1)) if literal else j.consts.get(m.group(1))
                if size != cf.array:
                    spelled = m.group(1) if literal else "%s = %s" % (m.group(1), size)
                    problem = "has %s elements, the header has %d" % (spelled, cf.array)
                elif not corresponds(cf.ctype, m.group(2), h, top=False):
                    problem = "has elements of %s, the header has %s" % (m.group(2), cf.ctype)
        elif not corresponds(cf.ctype, jtype, h, top=False):
            problem = "is %s, the header has %s (expected %s)" % (jtype, cf.ctype, accepted(cf.ctype, h))
        if problem:
            errors.append("%s: field %d (%s) %s" % (where, i + 1, jname, problem))
    return errors


def check(header_text: str, julia_text: str, verbose: bool = False, out=sys.stdout) -> List[str]:
    h = parse_header(header_text)
    j = parse_julia(julia_text)
    errors = []
    if not j.calls:
        errors.append("no ccall((:sf_..., lib), ...) found in the Julia file")
    used_structs = set()
    for c in j.calls:
        where = "line %d: ccall of %s" % (c.line, c.function)
        if c.function not in h.functions:
            errors.append("%s: the header declares no SF_API function %s" % (where, c.function))
            continue
        cret, cargs = h.functions[c.function]
        for t in [cret] + cargs:
            if t.pointers and t.base in h.structs:
                used_structs.add(t.base)
        bad = False
        if not corresponds(cret, c.ret, h, is_return=True):
            errors.append("%s: returns %s, the header returns %s (expected %s)"
                          % (where, c.ret, cret, accepted(cret, h)))
            bad = True
        if len(c.args) != len(cargs):
            errors.append("%s: %d argument types, the header has %d (%s)"
                          % (where, len(c.args), len(cargs), ", ".join(map(str, cargs)) or "void"))
            bad = True
        else:
            for i, (ct, jt) in enumerate(zip(cargs, c.args)):
                if not corresponds(ct, jt, h):
                    errors.append("%s: argument %d is %s, the header has %s (expected %s)"
                                  % (where, i + 1, jt, ct, accepted(ct, h)))
                    bad = True
        if c.nactual != len(c.args):
            errors.append("%s: %d argument types but %d arguments passed" % (where, len(c.args), c.nactual))
            bad = True
        if verbose and not bad:
            print("ok   line %4d  %s" % (c.line, c.function), file=out)
    mirrors = 0
    for c_name, cfields in h.structs.items():
        js = j.structs.get(camel(c_name))
        if js is None:
            if c_name in used_structs:
                errors.append("struct %s: passed to a called function, but the Julia file has no struct %s"
                              % (c_name, camel(c_name)))
            continue
        mirrors += 1
        struct_errors = check_struct(c_name, cfields, js, h, j)
        errors.extend(struct_errors)
        if verbose and not struct_errors:
            print("ok   struct %s == %s (%d fields)" % (js.name, c_name, len(cfields)), file=out)
    if verbose:
        called = {c.function for c in j.calls}
        unused = sorted(set(h.functions) - called)
        print("%d ccalls of %d sfsync functions, %d struct mirrors; not called: %s"
              % (len(j.calls), len(called), mirrors, ", ".join(unused) or "none"), file=out)
    return errors


def run_check(header_path: str, julia_path: str, verbose: bool) -> int:
    try:
        with open(header_path, encoding="utf-8") as f:
            header_text = f.read()
        with open(julia_path, encoding="utf-8") as f:
            julia_text = f.read()
        errors = check(header_text, julia_text, verbose)
    except (OSError, ParseError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    for e in errors:
        print("MISMATCH %s: %s" % (os.path.basename(julia_path), e), file=sys.stderr)
    if errors:
        print("FAILED: %d mismatch(es) between %s and %s" % (len(errors), julia_path, header_path), file=sys.stderr)
        return 1
    print("OK: %s corresponds to %s" % (julia_path, header_path))
    return 0


# ---- Self-test -------------------------------------------------------------

# (what it breaks, file, old text, new text, a word the error must contain)
MUTATIONS = [
    ("return type Int64 for sf_synchronize", "jl",
     "ccall((:sf_synchronize, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx)",
     "ccall((:sf_synchronize, LIBSFSYNC), Int64, (Ptr{Cvoid},), ctx)", "sf_synchronize"),
    ("Float32 for a double argument", "jl",
     "(Ptr{Cvoid}, Cdouble), ctx, mb))\nset_first", "(Ptr{Cvoid}, Float32), ctx, mb))\nset_first",
     "sf_set_bucket_cap_mb"),
    ("Int32 for the int64_t numel", "jl",
     "(Ptr{Cvoid}, Ptr{Cvoid}, Int64, Int32, Int32, Cstring, Ref{Int64})",
     "(Ptr{Cvoid}, Ptr{Cvoid}, Int32, Int32, Int32, Cstring, Ref{Int64})", "sf_register_gradient"),
    ("the wrong struct behind a pointer", "jl",
     "(Ptr{Cvoid}, Ref{SfStats}), ctx, s)", "(Ptr{Cvoid}, Ref{SfOptions}), ctx, s)", "sf_get_stats"),
    ("a missing argument type", "jl",
     "Int32, (Ptr{Cvoid}, Int64), ctx, id))", "Int32, (Ptr{Cvoid},), ctx, id))", "sf_grad_ready"),
    ("a value instead of a pointer", "jl",
     "(Ptr{Cvoid}, Int64, Ref{Ptr{Cvoid}}), ctx, id, p)", "(Ptr{Cvoid}, Int64, Ptr{Cvoid}), ctx, id, p)",
     "sf_gradient_data"),
    ("Int64 for const char* return", "jl",
     "ccall((:sf_last_error, LIBSFSYNC), Cstring, ())", "ccall((:sf_last_error, LIBSFSYNC), Int64, ())",
     "sf_last_error"),
    ("a function the header lacks", "jl",
     "ccall((:sf_zero_gradients, LIBSFSYNC)", "ccall((:sf_zero_gradient, LIBSFSYNC)", "sf_zero_gradient"),
    ("two struct fields swapped", "jl",
     "    early_launches::Int64\n    bytes_reduced::Int64\n",
     "    bytes_reduced::Int64\n    early_launches::Int64\n", "SfStats"),
    ("a struct field dropped", "jl", "    reserved0::Int32\n", "", "SfOptions"),
    ("a struct field of the wrong width", "jl", "    timeout_ms::Int64\n", "    timeout_ms::Int32\n", "timeout_ms"),
    ("a char array of the wrong size", "jl",
     "rendezvous::NTuple{SF_RENDEZVOUS_MAX,UInt8}", "rendezvous::NTuple{255,UInt8}", "rendezvous"),
    ("a mutable struct mirror", "jl", "\nstruct SfStats\n", "\nmutable struct SfStats\n", "immutable"),
    ("the header changes a parameter", "h",
     "sf_grad_ready(sf_context* ctx, int64_t id)", "sf_grad_ready(sf_context* ctx, int32_t id)", "sf_grad_ready"),
    ("the header grows sf_stats in the middle", "h",
     "  int64_t bucket_count;", "  int64_t new_counter;\n  int64_t bucket_count;", "SfStats"),
]


def self_test(header_path: str, julia_path: str) -> int:
    with open(header_path, encoding="utf-8") as f:
        header_text = f.read()
    with open(julia_path, encoding="utf-8") as f:
        julia_text = f.read()
    failures = []
    clean = check(header_text, julia_text)
    if clean:
        failures.append("the unmodified files do not pass: %s" % clean)
    for what, which, old, new, word in MUTATIONS:
        src = julia_text if which == "jl" else header_text
        if src.count(old) != 1:
            failures.append("mutation '%s': its text occurs %d times in the %s file (update MUTATIONS)"
                            % (what, src.count(old), which))
            continue
        mutated = src.replace(old, new)
        errors = check(header_text, mutated) if which == "jl" else check(mutated, julia_text)
        if not errors:
            failures.append("mutation '%s' was NOT detected" % what)
        elif not any(word in e for e in errors):
            failures.append("mutation '%s' was detected, but no message names '%s': %s" % (what, word, errors))
        else:
            print("detected: %-42s -> %s" % (what, errors[0]))
    # The command line must turn a mismatch into exit status 1.
    what, _, old, new, _ = MUTATIONS[0]
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "bad.jl")
        with open(bad, "w", encoding="utf-8") as f:
            f.write(julia_text.replace(old, new))
        for path, want in ((julia_path, 0), (bad, 1)):
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--header", header_path, "--julia", path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            if rc != want:
                failures.append("command line on %s: exit status %d, expected %d" % (path, rc, want))
    for f in failures:
        print("SELF-TEST FAILED: %s" % f, file=sys.stderr)
    if failures:
        return 1
    print("OK: the unmodified binding passes, all %d mutations are rejected, the CLI exits 0/1" % len(MUTATIONS))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--header", default=DEFAULT_HEADER, help="include/sfsync.h")
    ap.add_argument("--julia", default=DEFAULT_JULIA, help="the Julia file with the ccalls")
    ap.add_argument("--self-test", action="store_true", help="check that known-bad bindings are rejected")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every call and struct checked")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test(a.header, a.julia)
    return run_check(a.header, a.julia, a.verbose)


if __name__ == "__main__":
    sys.exit(main())
