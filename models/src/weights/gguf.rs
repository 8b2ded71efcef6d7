//! GGUF files (llama.cpp's format), read with every length checked against the file before anything is
//! allocated, and with llama.cpp's split files (`NAME-00001-of-00005.gguf`) joined into one model.
//!
//! Layout (ggml's GGUF spec, versions 2 and 3, little-endian): magic `GGUF`, version, tensor count, metadata
//! count, the metadata key/values, the tensor infos (name, dims in ggml order — fastest first —, type,
//! offset), padding to `general.alignment`, then the tensor data. A tensor's torch shape is its ggml dims
//! reversed.
//!
//! candle-core has its own reader (`gguf_file::Content::read`), but it rejects the whole file on the first
//! tensor of a type it lacks without naming the tensor, and divides by a `general.alignment` of 0: this
//! reader keeps every tensor's type as written, so the loader can name the tensor and its type, and reads the
//! metadata into candle's [`Value`] so candle's tokenizer builder can use it.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

/// Why a GGUF file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (glm5 reads versions 2 and 3)")]
    Version { path: PathBuf, version: u32 },
    #[error("{path} is truncated: it ends inside {what}")]
    Truncated { path: PathBuf, what: String },
    #[error("{path}: malformed header: {reason}")]
    Header { path: PathBuf, reason: String },
    #[error(
        "{path}: tensor `{tensor}` has ggml type id {type_id}, which is not a ggml type this reader knows"
    )]
    UnknownType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
    },
    #[error(
        "tensor `{tensor}` is stored as {type_name}, which glm5 cannot compute with yet; glm5 reads F32, \
         F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, \
         IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL and IQ4_XS (see docs/gguf.md for which published files load)"
    )]
    UnsupportedType { tensor: String, type_name: String },
    #[error(
        "{path}: tensor `{tensor}` ({type_name}, dims {dims:?}) needs bytes {start}..{end}, but the file \
         has {file_size}"
    )]
    OutOfRange {
        path: PathBuf,
        tensor: String,
        type_name: String,
        dims: Vec<u64>,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error("{path}: tensor `{tensor}`: {reason}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("split GGUF {path}: {reason}")]
    Split { path: PathBuf, reason: String },
    #[error("GGUF metadata `{key}`: {reason}")]
    Metadata { key: String, reason: String },
    #[error("GGUF has no tensor `{name}`")]
    MissingTensor { name: String },
}

pub type Result<T> = std::result::Result<T, GgufError>;

/// A ggml tensor type: its id in the file, name, and storage (`block` values in `bytes` bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub block: u64,
    pub bytes: u64,
}

/// Every type of llama.cpp's `GGMLQuantizationType` with its block size and bytes per block
/// (`GGML_QUANT_SIZES` in gguf-py's constants.py).
const GGML_TYPES: &[GgmlType] = &[
    t(0, "F32", 1, 4),
    t(1, "F16", 1, 2),
    t(2, "Q4_0", 32, 18),
    t(3, "Q4_1", 32, 20),
    t(6, "Q5_0", 32, 22),
    t(7, "Q5_1", 32, 24),
    t(8, "Q8_0", 32, 34),
    t(9, "Q8_1", 32, 36),
    t(10, "Q2_K", 256, 84),
    t(11, "Q3_K", 256, 110),
    t(12, "Q4_K", 256, 144),
    t(13, "Q5_K", 256, 176),
    t(14, "Q6_K", 256, 210),
    t(15, "Q8_K", 256, 292),
    t(16, "IQ2_XXS", 256, 66),
    t(17, "IQ2_XS", 256, 74),
    t(18, "IQ3_XXS", 256, 98),
    t(19, "IQ1_S", 256, 50),
    t(20, "IQ4_NL", 32, 18),
    t(21, "IQ3_S", 256, 110),
    t(22, "IQ2_S", 256, 82),
    t(23, "IQ4_XS", 256, 136),
    t(24, "I8", 1, 1),
    t(25, "I16", 1, 2),
    t(26, "I32", 1, 4),
    t(27, "I64", 1, 8),
    t(28, "F64", 1, 8),
    t(29, "IQ1_M", 256, 56),
    t(30, "BF16", 1, 2),
    t(34, "TQ1_0", 256, 54),
    t(35, "TQ2_0", 256, 66),
    t(39, "MXFP4", 32, 17),
    t(40, "NVFP4", 64, 36),
    t(41, "Q1_0", 128, 18),
    t(42, "Q2_0", 64, 18),
];

const fn t(id: u32, name: &'static str, block: u64, bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        block,
        bytes,
    }
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().copied().find(|t| t.id == id)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        GGML_TYPES
            .iter()
            .copied()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }

    /// candle's type, where candle can load and multiply it (on CPU and CUDA).
    pub fn candle(self) -> Option<GgmlDType> {
        Some(match self.id {
            0 => GgmlDType::F32,
            1 => GgmlDType::F16,
            30 => GgmlDType::BF16,
            2 => GgmlDType::Q4_0,
            3 => GgmlDType::Q4_1,
            6 => GgmlDType::Q5_0,
            7 => GgmlDType::Q5_1,
            8 => GgmlDType::Q8_0,
            10 => GgmlDType::Q2K,
            11 => GgmlDType::Q3K,
            12 => GgmlDType::Q4K,
            13 => GgmlDType::Q5K,
            14 => GgmlDType::Q6K,
            _ => return None,
        })
    }

    /// Whether values are stored as plain floats (F32/F16/BF16), not in quantised blocks.
    pub fn is_float(self) -> bool {
        matches!(self.id, 0 | 1 | 30)
    }
}

/// One tensor's entry in a GGUF header.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// ggml order: fastest-varying first (the reverse of torch's shape).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data in its file.
    pub start: u64,
    pub bytes: u64,
    /// Index of the split part holding it.
    pub part: usize,
}

impl GgufTensor {
    /// torch order: slowest-varying first.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// One file's header, checked: every tensor's data lies inside the file.
#[derive(Debug)]
pub struct GgufHeader {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<GgufTensor>,
    pub file_size: u64,
}

/// Longest metadata string and most array items accepted (llama.cpp's own caps are 2^30 too); lengths are
/// also checked against the bytes left in the file, so nothing is allocated that the file does not hold.
const MAX_STRING: u64 = 1 << 30;
const MAX_ITEMS: u64 = 1 << 30;
const MAX_DIMS: u32 = 4;
/// Array items over all metadata (GLM-5's tokenizer arrays hold ~0.5M) and tensors per file (GLM-5 has
/// ~1,800 in all): each parsed item costs tens of bytes of memory, so these caps bound what a hostile
/// header can make glm5 allocate.
const MAX_METADATA_ITEMS: u64 = 1 << 24;
const MAX_TENSORS: u64 = 1 << 20;
/// Arrays of arrays are legal; deeper than this is an attack on the stack.
const MAX_DEPTH: usize = 8;
/// Longest metadata key or tensor name accepted (GLM-5's are under 100 bytes; llama.cpp's tensor names
/// under 64): errors quote them.
const MAX_NAME_BYTES: usize = 1024;

struct Cursor<R> {
    inner: R,
    pos: u64,
    size: u64,
    path: PathBuf,
    /// Metadata array items read so far.
    items: u64,
}

impl<R: Read> Cursor<R> {
    fn left(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<Vec<u8>> {
        if n > self.left() {
            return Err(GgufError::Truncated {
                path: self.path.clone(),
                what: what(),
            });
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::UnexpectedEof => GgufError::Truncated {
                    path: self.path.clone(),
                    what: what(),
                },
                _ => GgufError::Io {
                    path: self.path.clone(),
                    source,
                },
            })?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(self.header(format!("{}: string of {len} bytes", what())));
        }
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes).map_err(|_| self.header(format!("{}: not UTF-8", what())))
    }

    /// A metadata key or tensor name: text that errors can quote on one line.
    fn name(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let name = self.string(what)?;
        if name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
            let preview: String = name.chars().take(64).collect();
            return Err(self.header(format!(
                "{} is not a name (control characters, or more than {MAX_NAME_BYTES} bytes): \"{}\"...",
                what(),
                preview.escape_debug()
            )));
        }
        Ok(name)
    }

    fn header(&self, reason: String) -> GgufError {
        GgufError::Header {
            path: self.path.clone(),
            reason,
        }
    }

    fn value(&mut self, type_id: u32, depth: usize, key: &str) -> Result<Value> {
        let what = || format!("the value of `{key}`");
        Ok(match type_id {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.header(format!("`{key}`: bool byte {b}"))),
            },
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(
                        self.header(format!("`{key}`: arrays nested deeper than {MAX_DEPTH}"))
                    );
                }
                let item_type = self.u32(&what)?;
                let len = self.u64(&what)?;
                let min_item = match item_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => 8,
                    9 => 12,
                    other => {
                        return Err(self.header(format!("`{key}`: array of value type {other}")))
                    }
                };
                if len > MAX_ITEMS || len.saturating_mul(min_item) > self.left() {
                    return Err(GgufError::Truncated {
                        path: self.path.clone(),
                        what: format!("`{key}` (an array of {len} items)"),
                    });
                }
                self.items = self.items.saturating_add(len);
                if self.items > MAX_METADATA_ITEMS {
                    return Err(self.header(format!(
                        "`{key}`: more than {MAX_METADATA_ITEMS} metadata array items in all"
                    )));
                }
                let mut items = Vec::with_capacity(len.min(1 << 16) as usize);
                for _ in 0..len {
                    items.push(self.value(item_type, depth + 1, key)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            other => return Err(self.header(format!("`{key}`: value type {other}"))),
        })
    }
}

impl GgufHeader {
    /// Reads and checks the header of one GGUF file (no tensor data is read).
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut c = Cursor {
            inner: BufReader::new(file),
            pos: 0,
            size,
            path: path.clone(),
            items: 0,
        };
        let magic: [u8; 4] = c.array(&|| "the magic".into())?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { path, found: magic });
        }
        let version = c.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version { path, version });
        }
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;
        // A key/value takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8.
        if n_kv
            .saturating_mul(13)
            .saturating_add(n_tensors.saturating_mul(24))
            > c.left()
        {
            return Err(GgufError::Truncated {
                path,
                what: format!(
                    "the header ({n_tensors} tensors and {n_kv} metadata entries declared)"
                ),
            });
        }
        if n_tensors > MAX_TENSORS {
            return Err(c.header(format!(
                "{n_tensors} tensors declared (at most {MAX_TENSORS})"
            )));
        }
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = c.name(&|| format!("metadata key #{i}"))?;
            let type_id = c.u32(&|| format!("the type of `{key}`"))?;
            let value = c.value(type_id, 0, &key)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.header(format!("metadata key `{key}` appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(Value::U32(a)) if a.is_power_of_two() => *a as u64,
            Some(other) => {
                return Err(c.header(format!(
                    "general.alignment must be a power of two (u32), got {other:?}"
                )))
            }
        };
        struct Info {
            name: String,
            dims: Vec<u64>,
            type_id: u32,
            offset: u64,
        }
        let mut infos = Vec::with_capacity(n_tensors.min(4096) as usize);
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = c.name(&|| format!("the name of tensor #{i}"))?;
            let what = || format!("the info of tensor `{name}`");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadTensor {
                    path,
                    tensor: name,
                    reason: format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let type_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            if !names.insert(name.clone()) {
                return Err(c.header(format!("tensor `{name}` appears twice")));
            }
            infos.push(Info {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(infos.len());
        for info in infos {
            let Some(ggml_type) = GgmlType::from_id(info.type_id) else {
                return Err(GgufError::UnknownType {
                    path,
                    tensor: info.name,
                    type_id: info.type_id,
                });
            };
            let bad = |reason: String| GgufError::BadTensor {
                path: path.clone(),
                tensor: info.name.clone(),
                reason,
            };
            if info.dims.contains(&0) {
                return Err(bad(format!("a zero dimension in {:?}", info.dims)));
            }
            if info.dims[0] % ggml_type.block != 0 {
                return Err(bad(format!(
                    "rows of {} values do not fill {} blocks of {}",
                    info.dims[0], ggml_type.name, ggml_type.block
                )));
            }
            if info.offset % alignment != 0 {
                return Err(bad(format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    info.offset
                )));
            }
            let elements = info
                .dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .ok_or_else(|| bad(format!("dims {:?} overflow", info.dims)))?;
            let bytes = (elements / ggml_type.block)
                .checked_mul(ggml_type.bytes)
                .ok_or_else(|| bad(format!("dims {:?} overflow", info.dims)))?;
            let start = data_start.checked_add(info.offset);
            let end = start.and_then(|s| s.checked_add(bytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= size => tensors.push(GgufTensor {
                    name: info.name,
                    dims: info.dims,
                    ggml_type,
                    start,
                    bytes,
                    part: 0,
                }),
                _ => {
                    return Err(GgufError::OutOfRange {
                        path,
                        tensor: info.name,
                        type_name: ggml_type.name.into(),
                        dims: info.dims,
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_size: size,
                    })
                }
            }
        }
        Ok(Self {
            path,
            version,
            metadata,
            tensors,
            file_size: size,
        })
    }
}

/// A model stored as one GGUF file or as llama.cpp split parts: the first part's metadata, every part's
/// tensors.
#[derive(Debug)]
pub struct GgufModel {
    pub parts: Vec<PathBuf>,
    pub metadata: HashMap<String, Value>,
    pub tensors: BTreeMap<String, GgufTensor>,
}

/// `(prefix, part number, part count)` of a split-part file name `PREFIX-00001-of-00005.gguf`.
pub fn split_part_name(path: &Path) -> Option<(String, usize, usize)> {
    let name = path.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (rest, count) = name.rsplit_once("-of-")?;
    let (prefix, number) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(number) || !digits(count) {
        return None;
    }
    Some((
        prefix.to_string(),
        number.parse().ok()?,
        count.parse().ok()?,
    ))
}

impl GgufModel {
    /// Opens `path`: a `.gguf` file (every part, if it is one of a split set), or a directory holding one
    /// `.gguf` model (one file, or the parts of one split set).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let parts = Self::parts_of(path)?;
        let headers = parts
            .iter()
            .map(GgufHeader::read)
            .collect::<Result<Vec<_>>>()?;
        let mut tensors = BTreeMap::new();
        let count = headers.len();
        for (index, header) in headers.iter().enumerate() {
            if count > 1 {
                let no = header
                    .metadata
                    .get("split.no")
                    .and_then(|v| v.to_u16().ok());
                let declared = header
                    .metadata
                    .get("split.count")
                    .and_then(|v| v.to_u16().ok());
                if no != Some(index as u16) || declared != Some(count as u16) {
                    return Err(GgufError::Split {
                        path: header.path.clone(),
                        reason: format!(
                            "its split.no/split.count say {no:?}/{declared:?}, expected part {index} of \
                             {count}"
                        ),
                    });
                }
            }
            for tensor in &header.tensors {
                let mut tensor = tensor.clone();
                tensor.part = index;
                let name = tensor.name.clone();
                if tensors.insert(name.clone(), tensor).is_some() {
                    return Err(GgufError::Split {
                        path: header.path.clone(),
                        reason: format!("tensor `{name}` is in two parts"),
                    });
                }
            }
        }
        if let Some(Ok(total)) = headers[0]
            .metadata
            .get("split.tensors.count")
            .map(|v| v.to_i32())
        {
            if total as usize != tensors.len() {
                return Err(GgufError::Split {
                    path: parts[0].clone(),
                    reason: format!(
                        "split.tensors.count is {total}, the parts hold {}",
                        tensors.len()
                    ),
                });
            }
        }
        let metadata = headers
            .into_iter()
            .next()
            .map(|h| h.metadata)
            .unwrap_or_default();
        Ok(Self {
            parts,
            metadata,
            tensors,
        })
    }

    /// The files of the model at `path`, first part first.
    fn parts_of(path: &Path) -> Result<Vec<PathBuf>> {
        let split_err = |reason: String| GgufError::Split {
            path: path.to_path_buf(),
            reason,
        };
        let file = if path.is_dir() {
            let mut ggufs: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|source| GgufError::Io {
                    path: path.to_path_buf(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
                .collect();
            ggufs.sort();
            let first = ggufs
                .iter()
                .find(|p| split_part_name(p).is_some_and(|(_, n, _)| n == 1))
                .or_else(|| (ggufs.len() == 1).then(|| &ggufs[0]));
            match first {
                Some(first) => first.clone(),
                None => {
                    return Err(split_err(format!(
                        "expected one .gguf file or the parts of one split model, found {}",
                        ggufs.len()
                    )))
                }
            }
        } else {
            path.to_path_buf()
        };
        let Some((prefix, _, count)) = split_part_name(&file) else {
            return Ok(vec![file]);
        };
        let dir = file.parent().unwrap_or(Path::new("."));
        let parts: Vec<PathBuf> = (1..=count)
            .map(|n| dir.join(format!("{prefix}-{n:05}-of-{count:05}.gguf")))
            .collect();
        if let Some(missing) = parts.iter().find(|p| !p.is_file()) {
            return Err(split_err(format!(
                "part {} of {count} is missing",
                missing.display()
            )));
        }
        Ok(parts)
    }

    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// Reads `bytes` bytes of `tensor`'s data starting `skip` bytes in.
    /// Where `tensor` (or its item `slice` along the slowest dim: one expert of a stacked tensor) lies in its
    /// data: `(bytes to skip, bytes, ggml dims)`.
    pub fn item(&self, tensor: &GgufTensor, slice: Option<usize>) -> Result<(u64, u64, Vec<u64>)> {
        let Some(i) = slice else {
            return Ok((0, tensor.bytes, tensor.dims.clone()));
        };
        let outer = *tensor.dims.last().unwrap_or(&1);
        if tensor.dims.len() < 2 || i as u64 >= outer {
            return Err(GgufError::BadTensor {
                path: self.parts[tensor.part].clone(),
                tensor: tensor.name.clone(),
                reason: format!("no item {i} in dims {:?}", tensor.dims),
            });
        }
        let each = tensor.bytes / outer;
        Ok((
            each * i as u64,
            each,
            tensor.dims[..tensor.dims.len() - 1].to_vec(),
        ))
    }

    /// The file (split part) holding `tensor`.
    pub fn part_path(&self, tensor: &GgufTensor) -> &Path {
        &self.parts[tensor.part]
    }

    pub fn read_bytes(&self, tensor: &GgufTensor, skip: u64, bytes: u64) -> Result<Vec<u8>> {
        let path = &self.parts[tensor.part];
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        if skip.saturating_add(bytes) > tensor.bytes {
            return Err(GgufError::BadTensor {
                path: path.clone(),
                tensor: tensor.name.clone(),
                reason: format!("bytes {skip}..{} asked of {}", skip + bytes, tensor.bytes),
            });
        }
        let mut file = File::open(path).map_err(io)?;
        file.seek(SeekFrom::Start(tensor.start + skip))
            .map_err(io)?;
        let mut buf = vec![0u8; bytes as usize];
        file.read_exact(&mut buf).map_err(|source| {
            if source.kind() == std::io::ErrorKind::UnexpectedEof {
                GgufError::OutOfRange {
                    path: path.clone(),
                    tensor: tensor.name.clone(),
                    type_name: tensor.ggml_type.name.into(),
                    dims: tensor.dims.clone(),
                    start: tensor.start,
                    end: tensor.start + tensor.bytes,
                    file_size: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
                }
            } else {
                io(source)
            }
        })?;
        Ok(buf)
    }

    /// `tensor` (or, with `slice = Some(i)`, item `i` of its slowest dimension, e.g. one expert of a stacked
    /// expert tensor) as a candle `QTensor` on `device`.
    pub fn qtensor(
        &self,
        tensor: &GgufTensor,
        slice: Option<usize>,
        device: &Device,
    ) -> Result<QTensor> {
        let Some(dtype) = tensor.ggml_type.candle() else {
            return Err(GgufError::UnsupportedType {
                tensor: tensor.name.clone(),
                type_name: tensor.ggml_type.name.into(),
            });
        };
        let (skip, bytes, dims) = self.item(tensor, slice)?;
        let data = self.read_bytes(tensor, skip, bytes)?;
        let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
        candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &data, shape, device).map_err(
            |e| GgufError::BadTensor {
                path: self.parts[tensor.part].clone(),
                tensor: tensor.name.clone(),
                reason: e.to_string(),
            },
        )
    }

    /// The metadata as candle's `Content` (no tensors), for candle's GGUF tokenizer builder.
    pub fn content(&self) -> Content {
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: self.metadata.clone(),
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string value.
    pub fn string(&self, key: &str) -> Result<&str> {
        match self.metadata.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(metadata_err(
                key,
                format!("expected a string, got {other:?}"),
            )),
            None => Err(metadata_err(key, "missing".into())),
        }
    }

    /// An unsigned integer value of any width.
    pub fn uint(&self, key: &str) -> Result<Option<u64>> {
        let Some(value) = self.metadata.get(key) else {
            return Ok(None);
        };
        let n = match value {
            Value::U8(v) => *v as u64,
            Value::U16(v) => *v as u64,
            Value::U32(v) => *v as u64,
            Value::U64(v) => *v,
            Value::I8(v) if *v >= 0 => *v as u64,
            Value::I16(v) if *v >= 0 => *v as u64,
            Value::I32(v) if *v >= 0 => *v as u64,
            Value::I64(v) if *v >= 0 => *v as u64,
            other => {
                return Err(metadata_err(
                    key,
                    format!("expected an unsigned integer, got {other:?}"),
                ))
            }
        };
        Ok(Some(n))
    }

    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        Ok(match self.metadata.get(key) {
            None => None,
            Some(Value::F32(v)) => Some(*v as f64),
            Some(Value::F64(v)) => Some(*v),
            Some(other) => {
                return Err(metadata_err(
                    key,
                    format!("expected a float, got {other:?}"),
                ))
            }
        })
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        Ok(match self.metadata.get(key) {
            None => None,
            Some(Value::Bool(v)) => Some(*v),
            Some(other) => {
                return Err(metadata_err(key, format!("expected a bool, got {other:?}")))
            }
        })
    }
}

pub(crate) fn metadata_err(key: &str, reason: String) -> GgufError {
    GgufError::Metadata {
        key: key.to_string(),
        reason,
    }
}
