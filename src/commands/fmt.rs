//! `hvd fmt`: rewrite a .hvd file in the canonical layout (comments kept), or `--check` that it is.

use std::io::Write as _;

use clap::Args;

use crate::exit::{CommandResult, Failure, Status};

#[derive(Debug, Args)]
pub struct FmtArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: std::path::PathBuf,

    /// Change nothing; exit 1 when the file is not formatted.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: FmtArgs) -> CommandResult {
    let usage = |d: hvd_lang::Diagnostics| Failure::new(Status::Usage, miette::Report::new(d));
    let text = hvd_lang::read(&args.file).map_err(usage)?;
    let formatted =
        hvd_lang::format_source(&args.file.display().to_string(), &text).map_err(usage)?;
    if formatted == text {
        if !args.check {
            println!("{} is already formatted", args.file.display());
        }
        return Ok(Status::Success);
    }
    if args.check {
        return Err(Failure::new(
            Status::Failure,
            miette::miette!(
                help = format!("run `hvd fmt {}`", args.file.display()),
                "{} is not formatted",
                args.file.display()
            ),
        ));
    }
    write_atomically(&args.file, &formatted).map_err(|e| {
        Failure::from_error_in(
            Status::Failure,
            format_args!("failed to write {}", args.file.display()),
            &e,
        )
    })?;
    println!("formatted {}", args.file.display());
    Ok(Status::Success)
}

/// Write next to the file, then rename over it: an interrupted `fmt` never leaves half a file.
fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".fmt-{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        if let Ok(meta) = std::fs::metadata(path) {
            std::fs::set_permissions(&tmp, meta.permissions())?;
        }
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
