//! Syntax: the AST with byte spans ([`ast`]) and the nom parser that builds it ([`parser`]).

pub mod ast;
pub mod parser;
