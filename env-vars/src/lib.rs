//! The one way an hvd crate declares the environment variables it reads or sets: [`env_vars!`] writes each
//! variable once and makes both its constant and its row in the crate's `ALL` table.
//!
//! ```
//! mod env_vars {
//!     hvd_env_vars::env_vars! {
//!         /// Where the store lives.
//!         HVD_STORE default "<data dir>/hvd/store";
//!         /// Searched for programs.
//!         PATH;
//!         /// Horovod's spelling of every setting: `HOROVOD_X` for `HVD_X`.
//!         HOROVOD_PREFIX = "HOROVOD_";
//!     }
//! }
//! assert_eq!(env_vars::HVD_STORE, "HVD_STORE");
//! assert_eq!(env_vars::HOROVOD_PREFIX, "HOROVOD_");
//! assert_eq!(
//!     env_vars::ALL[0],
//!     ("HVD_STORE", "<data dir>/hvd/store", "Where the store lives.")
//! );
//! assert_eq!(env_vars::ALL[1], ("PATH", "", "Searched for programs."));
//! ```

#![no_std]

/// Declares environment variables: per variable its documentation (one or more `///` lines, required), optional
/// `#[allow(...)]` attributes, its name, an optional `= "VALUE"` when the constant's value is not its name (a
/// prefix such as `HOROVOD_PREFIX = "HOROVOD_"`), an optional `default "VALUE"` (what unset means; none: unset
/// means none or off), and `;`.
///
/// It makes `pub const NAME: &str` for each (the documentation, plus the default, as its rustdoc) and
/// `pub const ALL: &[(&str, &str, &str)]`: `(value, default or "", the documentation as one line)` in the order
/// declared. A name declared twice does not compile.
#[macro_export]
macro_rules! env_vars {
    ($(
        $(#[doc = $doc:literal])+
        $(#[allow($($allow:tt)*)])*
        $name:ident $(= $value:literal)? $(default $default:literal)?;
    )*) => {
        $(
            $(#[doc = $doc])+
            $(#[doc = concat!("\n\nDefault, or the value set: `", $default, "`.")])?
            $(#[allow($($allow)*)])*
            pub const $name: &str = $crate::__value!($name $($value)?);
        )*

        /// `(name, default or "" when unset means none/off, meaning)` for every constant above.
        #[allow(dead_code, reason = "a binary crate's registry is read by tests only")]
        pub const ALL: &[(&str, &str, &str)] = &[$(
            (
                $name,
                $crate::__default!($($default)?),
                concat!($($doc),+).trim_ascii(),
            )
        ),*];
    };
}

/// The range, in seconds, of an elastic step's round window: `workers = { elastic_timeout }` in a file,
/// `hvd run --elastic-timeout`, and the `HVD_ELASTIC_TIMEOUT` a worker reads are all checked against it, so a value
/// the file or the flag takes is one every worker takes. At least 1 s (shorter, a round waits for nobody but the
/// first worker to rejoin); at most a day (longer is a typo, and `Instant + it` could overflow).
pub const ELASTIC_TIMEOUT_SECONDS: (u64, u64) = (1, 24 * 60 * 60);

/// A constant's value: its name, or the value written after `=`.
#[doc(hidden)]
#[macro_export]
macro_rules! __value {
    ($name:ident) => {
        stringify!($name)
    };
    ($name:ident $value:literal) => {
        $value
    };
}

/// A variable's default: the one written, else `""`.
#[doc(hidden)]
#[macro_export]
macro_rules! __default {
    () => {
        ""
    };
    ($default:literal) => {
        $default
    };
}
