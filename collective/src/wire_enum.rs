//! [`wire_enum!`](crate::wire_enum): a fieldless enum whose discriminants are wire codes, declared once with its
//! code and name conversions.

/// Declares an enum whose discriminants are codes that cross a process or ABI boundary (the repr is written after
/// the name): each variant once, in code order (the first may set where the codes start; each next one is the
/// code after it, as Rust numbers discriminants). With it: `ALL` (every value, in code order), `code()`,
/// `from_code()` (unknown codes: `None`, never a panic), `name()` (the variant's name in lower case) and `named()`.
/// Every such enum is `Debug, Clone, Copy, PartialEq, Eq, Hash`; other attributes (docs) go before `enum` and
/// before each variant.
///
/// ```
/// hvd_collective::wire_enum! {
///     /// A color.
///     pub enum Color: u8 {
///         Red = 1,
///         Green,
///         DeepBlue,
///     }
/// }
/// assert_eq!(Color::ALL, [Color::Red, Color::Green, Color::DeepBlue]);
/// assert_eq!(Color::from_code(2), Some(Color::Green));
/// assert_eq!(Color::from_code(0), None);
/// assert_eq!(Color::DeepBlue.code(), 3);
/// assert_eq!(Color::named("green"), Some(Color::Green));
/// assert_eq!(Color::DeepBlue.name(), "deepblue");
/// ```
#[macro_export]
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $($(#[$vmeta:meta])* $variant:ident $(= $code:literal)?),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        $vis enum $name {
            $($(#[$vmeta])* $variant $(= $code)?),+
        }

        impl $name {
            /// Every value, in code order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];

            /// The wire code.
            pub const fn code(self) -> $repr {
                self as $repr
            }

            /// The value whose [`code`](Self::code) is `code`.
            pub const fn from_code(code: $repr) -> Option<$name> {
                match code {
                    $(c if c == $name::$variant as $repr => Some($name::$variant),)+
                    _ => None,
                }
            }

            /// The name: the variant's, in lower case.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => {
                        const NAME: [u8; stringify!($variant).len()] =
                            $crate::wire_enum::ascii_lowercase(stringify!($variant));
                        match ::core::str::from_utf8(&NAME) {
                            Ok(name) => name,
                            Err(_) => panic!("a variant's name is ASCII"),
                        }
                    })+
                }
            }

            /// The value whose [`name`](Self::name) is `name`.
            pub fn named(name: &str) -> Option<$name> {
                $name::ALL.into_iter().find(|v| v.name() == name)
            }
        }
    };
}

/// `text` in ASCII lower case, at compile time (`N` is its length).
pub const fn ascii_lowercase<const N: usize>(text: &str) -> [u8; N] {
    let bytes = text.as_bytes();
    let mut out = [0u8; N];
    let mut i = 0;
    while i < N {
        out[i] = bytes[i].to_ascii_lowercase();
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::{DType, ReduceOp};

    /// The codes are on the wire (the operation header) and the names in messages: both stay put.
    #[test]
    fn codes_and_names_stay_put() {
        assert_eq!(DType::ALL.map(DType::code), [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            DType::ALL.map(DType::name),
            ["f16", "bf16", "f32", "f64", "i8", "u8", "i32", "i64"]
        );
        assert_eq!(ReduceOp::ALL.map(ReduceOp::code), [1, 2, 3, 4, 5]);
        assert_eq!(
            ReduceOp::ALL.map(ReduceOp::name),
            ["sum", "average", "min", "max", "product"]
        );
        for code in [0, 9, 255] {
            assert_eq!(DType::from_code(code), None);
        }
        assert_eq!(ReduceOp::named("max"), Some(ReduceOp::Max));
        assert_eq!(ReduceOp::named("Max"), None);
    }
}
