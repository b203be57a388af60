//! Simple-API project pages parsed into [`IndexFile`]s: PEP 691 JSON and PEP 503 HTML. Listed digests are
//! validated where they are read, and only http(s) file URLs are accepted.

use reqwest::Url;
use serde::Deserialize;

use super::IndexFile;
use crate::digest::Sha256;

#[derive(Deserialize)]
struct JsonPage {
    files: Vec<JsonFile>,
}

#[derive(Deserialize)]
struct JsonFile {
    filename: String,
    url: String,
    #[serde(default)]
    hashes: std::collections::BTreeMap<String, String>,
    #[serde(default, rename = "requires-python")]
    requires_python: Option<String>,
    #[serde(default)]
    yanked: serde_json::Value,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "core-metadata")]
    core_metadata: serde_json::Value,
    #[serde(default, rename = "dist-info-metadata")]
    dist_info_metadata: serde_json::Value,
}

fn truthy(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::String(_) | serde_json::Value::Object(_) => true,
        _ => false,
    }
}

fn absolute(base: &Url, href: &str) -> Result<(String, Option<String>), String> {
    let mut url = base
        .join(href)
        .map_err(|e| format!("bad file url `{href}`: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "file url `{}` has scheme `{}`; an index may only list http(s) files",
            href.escape_debug(),
            url.scheme()
        ));
    }
    let fragment = url.fragment().map(str::to_string);
    url.set_fragment(None);
    Ok((url.to_string(), fragment))
}

/// A listed sha256, validated where it is parsed: anything but 64 hex digits refuses the page, naming the file.
fn listed_sha256(filename: &str, value: Option<&str>) -> Result<Option<Sha256>, String> {
    value
        .map(|v| {
            v.parse::<Sha256>().map_err(|e| {
                format!(
                    "the sha256 listed for file `{}` is wrong: {e}; refusing the page",
                    filename.escape_debug()
                )
            })
        })
        .transpose()
}

/// The PEP 658/714 metadata digest: `{"sha256": "..."}` (`true` means served, digest unknown).
fn metadata_sha256(filename: &str, v: &serde_json::Value) -> Result<Option<Sha256>, String> {
    match v.get("sha256") {
        Some(serde_json::Value::String(h)) => listed_sha256(filename, Some(h)),
        Some(_) => Err(format!(
            "file `{}` lists a non-string core-metadata sha256; refusing the page",
            filename.escape_debug()
        )),
        None => Ok(None),
    }
}

/// Parse a PEP 691 JSON project page. Listed sha256 digests are validated here (64 hex digits).
pub(crate) fn parse_json_page(body: &[u8], base: &Url) -> Result<Vec<IndexFile>, String> {
    let page: JsonPage = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    page.files
        .into_iter()
        .map(|f| {
            let (url, _) = absolute(base, &f.url)?;
            let sha256 = listed_sha256(&f.filename, f.hashes.get("sha256").map(String::as_str))?;
            let core_metadata_sha256 = if truthy(&f.core_metadata) {
                metadata_sha256(&f.filename, &f.core_metadata)?
            } else {
                metadata_sha256(&f.filename, &f.dist_info_metadata)?
            };
            Ok(IndexFile {
                filename: f.filename,
                url,
                sha256,
                size: f.size,
                requires_python: f.requires_python.filter(|s| !s.trim().is_empty()),
                yanked: truthy(&f.yanked),
                core_metadata: truthy(&f.core_metadata) || truthy(&f.dist_info_metadata),
                core_metadata_sha256,
            })
        })
        .collect()
}

fn html_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

fn attribute(tag: &str, name: &str) -> Option<String> {
    let lower = tag.to_ascii_lowercase();
    let mut from = 0;
    while let Some(pos) = lower[from..].find(name) {
        let at = from + pos;
        from = at + name.len();
        let before_ok = at == 0 || lower.as_bytes()[at - 1].is_ascii_whitespace();
        let rest = tag[at + name.len()..].trim_start();
        if !before_ok {
            continue;
        }
        let Some(rest) = rest.strip_prefix('=') else {
            if rest.starts_with(['>', ' ', '/']) || rest.is_empty() {
                return Some(String::new());
            }
            continue;
        };
        let rest = rest.trim_start();
        let value = if let Some(r) = rest.strip_prefix('"') {
            r.split('"').next().unwrap_or("")
        } else if let Some(r) = rest.strip_prefix('\'') {
            r.split('\'').next().unwrap_or("")
        } else {
            rest.split([' ', '>']).next().unwrap_or("")
        };
        return Some(html_unescape(value));
    }
    None
}

/// Parse a PEP 503 HTML project page (anchors with `data-*` attributes). A `#sha256=` fragment that is not 64
/// hex digits refuses the page.
pub(crate) fn parse_html_page(body: &str, base: &Url) -> Result<Vec<IndexFile>, String> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(start) = rest.find("<a ").or_else(|| rest.find("<A ")) {
        let after = &rest[start..];
        let Some(tag_end) = after.find('>') else {
            break;
        };
        let tag = &after[..tag_end];
        let Some(close) = after[tag_end..]
            .find("</a>")
            .or_else(|| after[tag_end..].find("</A>"))
        else {
            break;
        };
        let text = html_unescape(after[tag_end + 1..tag_end + close].trim());
        rest = &after[tag_end + close..];
        let Some(href) = attribute(tag, "href") else {
            continue;
        };
        let Ok((url, fragment)) = absolute(base, &href) else {
            continue;
        };
        let sha256 = listed_sha256(
            &text,
            fragment.as_deref().and_then(|f| f.strip_prefix("sha256=")),
        )?;
        let metadata_attr = attribute(tag, "data-core-metadata")
            .or_else(|| attribute(tag, "data-dist-info-metadata"));
        let core_metadata_sha256 = listed_sha256(
            &text,
            metadata_attr
                .as_deref()
                .and_then(|v| v.strip_prefix("sha256=")),
        )?;
        out.push(IndexFile {
            filename: text,
            url,
            sha256,
            size: None,
            requires_python: attribute(tag, "data-requires-python")
                .filter(|s| !s.trim().is_empty()),
            yanked: attribute(tag, "data-yanked").is_some(),
            core_metadata: metadata_attr.is_some_and(|v| v != "false"),
            core_metadata_sha256,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(c: char) -> String {
        c.to_string().repeat(64)
    }

    #[test]
    fn parses_html_anchors() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let html = format!(
            r#"<html><body>
<a href="../../files/foo-1.0.tar.gz#sha256={}" data-requires-python="&gt;=3.8">foo-1.0.tar.gz</a><br/>
<a href="http://127.0.0.1:9/files/foo-0.9-py3-none-any.whl" data-yanked="" data-core-metadata="sha256={}">foo-0.9-py3-none-any.whl</a>
</body></html>"#,
            hex('A'),
            hex('c')
        );
        let files = parse_html_page(&html, &base).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].url, "http://127.0.0.1:9/files/foo-1.0.tar.gz");
        assert_eq!(
            files[0].sha256.as_ref().map(Sha256::as_str),
            Some(hex('a').as_str())
        );
        assert_eq!(files[0].requires_python.as_deref(), Some(">=3.8"));
        assert!(!files[0].yanked);
        assert!(files[1].yanked && files[1].sha256.is_none() && files[1].core_metadata);
        assert_eq!(
            files[1].core_metadata_sha256.as_ref().map(Sha256::as_str),
            Some(hex('c').as_str())
        );
    }

    #[test]
    fn parses_json_page() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let body = format!(
            r#"{{"meta":{{"api-version":"1.1"}},"name":"foo","files":[
{{"filename":"foo-1.0-py3-none-any.whl","url":"/files/foo-1.0-py3-none-any.whl","hashes":{{"sha256":"{}"}},"yanked":"broken","size":12,"core-metadata":{{"sha256":"{}"}}}}]}}"#,
            hex('a'),
            hex('b')
        );
        let files = parse_json_page(body.as_bytes(), &base).unwrap();
        assert_eq!(
            files[0].url,
            "http://127.0.0.1:9/files/foo-1.0-py3-none-any.whl"
        );
        assert!(files[0].yanked && files[0].core_metadata);
        assert_eq!(
            files[0].core_metadata_sha256.as_ref().unwrap().as_str(),
            hex('b')
        );
        assert!(parse_json_page(b"{", &base).is_err());
    }

    /// Issue 16 item 1: the listed sha256 became part of a cache file name and of the lockfile.
    #[test]
    fn path_traversal_in_listed_sha256_refuses_the_page() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        for hostile in ["../../../../tmp/hvd-pwned", "/etc/passwd", "", "aa", "zz"] {
            let body = format!(
                r#"{{"files":[{{"filename":"foo-1.0-py3-none-any.whl","url":"/f/foo-1.0-py3-none-any.whl","hashes":{{"sha256":"{hostile}"}}}}]}}"#
            );
            let err = parse_json_page(body.as_bytes(), &base).unwrap_err();
            assert!(
                err.contains("foo-1.0-py3-none-any.whl") && err.contains("not a sha256"),
                "{err}"
            );
            let html =
                format!(r#"<a href="/f/foo-1.0.tar.gz#sha256={hostile}">foo-1.0.tar.gz</a>"#);
            let err = parse_html_page(&html, &base).unwrap_err();
            assert!(
                err.contains("foo-1.0.tar.gz") && err.contains("not a sha256"),
                "{err}"
            );
            let body = format!(
                r#"{{"files":[{{"filename":"foo-1.0-py3-none-any.whl","url":"/f/foo-1.0-py3-none-any.whl","core-metadata":{{"sha256":"{hostile}"}}}}]}}"#
            );
            assert!(parse_json_page(body.as_bytes(), &base).is_err());
        }
    }

    #[test]
    fn json_page_listing_a_local_file_is_refused() {
        let base = Url::parse("http://127.0.0.1:9/simple/foo/").unwrap();
        let body =
            br#"{"files":[{"filename":"foo-1.0-py3-none-any.whl","url":"file:///etc/passwd"}]}"#;
        let err = parse_json_page(body, &base).unwrap_err();
        assert!(err.contains("scheme `file`"), "{err}");
    }
}
