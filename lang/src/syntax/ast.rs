//! The abstract syntax tree of a `.hvd` file. Every node carries the byte span it was parsed from, so the
//! evaluator can point diagnostics at the source and the formatter can put comments back where they were.

use std::rc::Rc;

/// A byte range `start..end` in one source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(start: u32, end: u32) -> Self {
        Span {
            start,
            end: end.max(start),
        }
    }

    pub fn len(self) -> u32 {
        self.end - self.start
    }
}

/// A parsed file: its items in source order and the comments found in it (for the formatter).
#[derive(Debug, Clone, Default)]
pub struct File {
    pub items: Vec<Item>,
    /// Spans of `# ...` comments (without the line break), sorted.
    pub comments: Vec<Span>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub struct Item {
    pub kind: ItemKind,
    pub span: Span,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Env,
    Resources,
    Cluster,
}

impl BlockKind {
    pub fn keyword(self) -> &'static str {
        match self {
            BlockKind::Env => "env",
            BlockKind::Resources => "resources",
            BlockKind::Cluster => "cluster",
        }
    }
}

#[derive(Debug, Clone)]
pub enum ItemKind {
    /// `project "name"`
    Project(Expr),
    /// `import std` or `import std as name`
    ImportStd { alias: Option<Ident> },
    /// `import "./file.hvd" as name`
    ImportFile {
        path: String,
        path_span: Span,
        alias: Ident,
    },
    /// `let name = expr`
    Let { name: Ident, value: Expr },
    /// `env { ... }`, `resources { ... }`, `cluster { ... }`
    Block {
        kind: BlockKind,
        keyword_span: Span,
        body: Attrs,
    },
    /// `step name { ... }`
    Step { name: Ident, body: Attrs },
}

/// `{ key = value ... }`: an attribute set literal, a block body or the arguments of a recipe call.
#[derive(Debug, Clone)]
pub struct Attrs {
    pub entries: Vec<Entry>,
    /// Whether the source put the entries on their own lines (the formatter keeps that choice).
    pub multiline: bool,
    /// From `{` to `}` inclusive.
    pub span: Span,
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub kind: EntryKind,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub enum EntryKind {
    /// `key = value`
    Field { key: Key, value: Expr },
    /// `for x in list: key = value`
    For {
        var: Ident,
        iter: Expr,
        key: Key,
        value: Expr,
    },
}

#[derive(Debug, Clone)]
pub struct Key {
    pub kind: KeyKind,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub enum KeyKind {
    Ident(String),
    /// A quoted key, possibly interpolated: `"HOROVOD_WITH_${fw}" = "1"`.
    Str(Vec<StrPart>),
}

#[derive(Debug, Clone)]
pub enum StrPart {
    Lit(String),
    Interp(Expr),
}

#[derive(Debug, Clone)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

/// A number literal's value after its unit is applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Int(i64),
    Float(f64),
    /// Bytes.
    Size(u64),
    /// Milliseconds.
    Duration(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Add,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Or => "||",
            BinOp::And => "&&",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Add => "+",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Param {
    pub name: Ident,
    pub default: Option<Expr>,
}

/// `recipe { params } => body`
#[derive(Debug)]
pub struct RecipeDef {
    pub params: Vec<Param>,
    pub params_multiline: bool,
    pub params_span: Span,
    pub body: Expr,
}

#[derive(Debug, Clone)]
pub enum ExprKind {
    None,
    Bool(bool),
    /// The literal text is kept so the formatter prints numbers as written.
    Number {
        text: String,
        value: Number,
    },
    Str(Vec<StrPart>),
    Ref(Ident),
    List {
        items: Vec<Expr>,
        multiline: bool,
    },
    /// `[for x in list: expr]`
    ListFor {
        var: Ident,
        iter: Box<Expr>,
        body: Box<Expr>,
    },
    Attrs(Attrs),
    /// `base.name`
    Field {
        base: Box<Expr>,
        name: Ident,
    },
    /// `recipe_value { args }`
    Call {
        callee: Box<Expr>,
        args: Attrs,
    },
    /// `contains(list, x)` and the other built-in functions.
    Builtin {
        name: Ident,
        args: Vec<Expr>,
    },
    Not(Box<Expr>),
    Binary {
        op: BinOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    If {
        cond: Box<Expr>,
        then: Box<Expr>,
        otherwise: Box<Expr>,
    },
    Recipe(Rc<RecipeDef>),
    Paren(Box<Expr>),
}
