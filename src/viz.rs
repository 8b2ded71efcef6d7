//! Pictures a notebook user would rather look at than read: which past tokens each layer's DSA indexer
//! selected for a query, as an SVG (shown inline by evcxr through [`SelectionMap::evcxr_display`]).

use std::fmt::Write;

/// The positions every layer attended to for one query token.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectionMap {
    /// The text of each position `0..=query`.
    pub tokens: Vec<String>,
    /// Per layer, the selected positions, ascending.
    pub layers: Vec<Vec<usize>>,
    /// The indexer's top-k (how many positions a layer may keep).
    pub index_topk: usize,
}

const CELL: usize = 10;
const LABEL: usize = 60;

impl SelectionMap {
    /// Position of the query (the last token).
    pub fn query(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// One row per layer, one column per position: filled where the layer attended.
    pub fn to_svg(&self) -> String {
        let (cols, rows) = (self.tokens.len(), self.layers.len());
        let (width, height) = (LABEL + cols * CELL + 10, 30 + rows * CELL + 20);
        let mut svg = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="9">"#
        );
        let _ = write!(
            svg,
            r#"<text x="0" y="12">DSA selections of the last token (position {}), top-{} of {} visible</text>"#,
            self.query(),
            self.index_topk,
            cols
        );
        for (layer, selected) in self.layers.iter().enumerate() {
            let y = 20 + layer * CELL;
            let _ = write!(
                svg,
                r#"<text x="0" y="{}">layer {layer}</text>"#,
                y + CELL - 2
            );
            for col in 0..cols {
                let fill = if selected.binary_search(&col).is_ok() {
                    "#1f5fbf"
                } else {
                    "#e8e8e8"
                };
                let _ = write!(
                    svg,
                    r#"<rect x="{}" y="{y}" width="{}" height="{}" fill="{fill}"><title>{}: {:?}</title></rect>"#,
                    LABEL + col * CELL,
                    CELL - 1,
                    CELL - 1,
                    col,
                    self.tokens[col]
                );
            }
        }
        let _ = write!(
            svg,
            r#"<text x="{LABEL}" y="{}">position 0 → {}</text></svg>"#,
            height - 4,
            self.query()
        );
        svg
    }

    /// evcxr's display hook: the notebook shows the SVG.
    pub fn evcxr_display(&self) {
        println!(
            "EVCXR_BEGIN_CONTENT image/svg+xml\n{}\nEVCXR_END_CONTENT",
            self.to_svg()
        );
    }
}
