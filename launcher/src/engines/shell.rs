//! POSIX shell quoting: the one place that turns words into text a `/bin/sh` splits back into the same words (ssh
//! command lines, batch scripts, `--dry-run` output).

/// Quotes `word` for a POSIX shell: unchanged when it is made only of characters no shell treats specially,
/// otherwise in single quotes (a `'` inside becomes `'\''`).
pub fn quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:,=@%+".contains(&b))
    {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Quotes every word of `argv` ([`quote`]) and joins them with spaces: one line a shell splits back into `argv`.
pub fn line<S: AsRef<str>>(argv: &[S]) -> String {
    argv.iter()
        .map(|word| quote(word.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// Runs `sh -c 'printf "[%s]" LINE'` to see how a real shell splits a quoted line.
    fn shell_words(line: &str) -> String {
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("printf '[%s]' {line}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "sh rejected `{line}`");
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn quoting_round_trips_through_a_shell() {
        let words = [
            "plain",
            "",
            "two words",
            "it's",
            "'",
            "''",
            "a\"b",
            "$HOME",
            "`id`",
            "$(id)",
            "a\\b",
            "new\nline",
            "\n",
            "trailing\n",
            "tab\there",
            "*",
            "~",
            "-x",
            "--flag=value",
            "-",
            "#comment",
            "ü",
            "!bang",
            "semi;colon&",
            "a|b>c<d",
            "{a,b}",
            "x=1 y",
        ];
        let joined = line(&words);
        let expected: String = words.iter().map(|w| format!("[{w}]")).collect();
        assert_eq!(shell_words(&joined), expected);
        // Each word alone, too: a lone `'` or empty word must not merge with its neighbours to come out right.
        for word in words {
            assert_eq!(shell_words(&quote(word)), format!("[{word}]"), "{word:?}");
        }
    }

    #[test]
    fn safe_words_stay_bare_and_the_rest_is_single_quoted() {
        assert_eq!(quote("a/b:c=d"), "a/b:c=d");
        assert_eq!(
            quote("-x"),
            "-x",
            "a leading `-` is not special to the shell"
        );
        assert_eq!(quote("--np=4"), "--np=4");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("'"), r"''\'''");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote("a\nb"), "'a\nb'");
        assert_eq!(quote("~"), "'~'");
        assert_eq!(line(&["a b", "it's"]), r"'a b' 'it'\''s'");
        assert_eq!(line(&[String::from("x"), String::new()]), "x ''");
        assert_eq!(line::<&str>(&[]), "");
    }

    #[test]
    fn a_command_quoted_twice_survives_two_shells() {
        // A command quoted for `sh -c`, the whole quoted again (as the ssh engine sends it), through two shells.
        let inner = format!("printf '[%s]' {}", line(&["it's $x", "", "-n", "a\nb"]));
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("exec /bin/sh -c {}", quote(&inner)))
            .output()
            .unwrap();
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "[it's $x][][-n][a\nb]"
        );
    }
}
