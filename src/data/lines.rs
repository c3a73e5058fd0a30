//! The one line reader of every text format arbor reads (SST, SICK, TU, word vectors): lines
//! streamed and numbered from 1 as an editor numbers them, a byte-order mark at the start of
//! the file dropped, `\r\n` read as `\n`, and a line that is not UTF-8 an error naming the file
//! and line.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// The lines of one file, as `(line number, text)`.
pub struct Lines {
    name: String,
    reader: BufReader<File>,
    number: usize,
    buf: Vec<u8>,
}

/// Opens `path` for reading line by line.
pub fn lines(path: &Path) -> Result<Lines> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|e| Error::Io { path: name.clone(), msg: e.to_string() })?;
    Ok(Lines { name, reader: BufReader::new(file), number: 0, buf: Vec::new() })
}

/// Every line of `path` (see [`lines`]).
pub fn read_all(path: &Path) -> Result<Vec<(usize, String)>> {
    lines(path)?.collect()
}

impl Iterator for Lines {
    type Item = Result<(usize, String)>;

    fn next(&mut self) -> Option<Self::Item> {
        self.buf.clear();
        match self.reader.read_until(b'\n', &mut self.buf) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => return Some(Err(Error::Io { path: self.name.clone(), msg: e.to_string() })),
        }
        self.number += 1;
        let mut bytes = self.buf.as_slice();
        if self.number == 1 {
            bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
        }
        bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
        bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        Some(match std::str::from_utf8(bytes) {
            Ok(text) => Ok((self.number, text.to_string())),
            Err(e) => Err(Error::Parse {
                file: self.name.clone(),
                line: self.number,
                msg: format!("not valid UTF-8 (byte {} of the line)", e.valid_up_to() + 1),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_endings_and_bad_bytes() {
        let path = std::env::temp_dir().join(format!("arbor-lines-{}", std::process::id()));
        std::fs::write(&path, b"\xef\xbb\xbfone\r\n\ntwo \xff\nthree").unwrap();
        let got: Vec<Result<(usize, String)>> = lines(&path).unwrap().collect();
        assert_eq!(got[0].as_ref().unwrap(), &(1, "one".to_string()));
        assert_eq!(got[1].as_ref().unwrap(), &(2, String::new()));
        let err = got[2].as_ref().unwrap_err().to_string();
        assert!(err.contains(":3:") && err.contains("UTF-8") && err.contains("byte 5"), "{err}");
        assert_eq!(got[3].as_ref().unwrap(), &(4, "three".to_string()));
        std::fs::remove_file(&path).ok();
    }
}
